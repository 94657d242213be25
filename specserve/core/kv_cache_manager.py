"""The block pool and per-request block tables (bookkeeping only, no tensors),
with automatic prefix caching.

A request's KV lives in fixed-size blocks; its block table lists them in order.
Blocks are added as the request grows (lookahead slots included) and all
released at once (finish, abort, preemption): rejecting draft tokens frees
nothing, their slots are overwritten by later tokens.

**Prefix caching.** A full block whose tokens are all verified (their KV is
final: prompt tokens, accepted drafts, never a draft still waiting for
verification) is registered under a hash of its tokens and of every token
before it (a chain: the key is ``(parent block's hash, tokens)``, so two
prefixes share a block only if the block's tokens are equal and their parents'
64-bit hashes are). The first block's parent is the request's *root*: None for
the base model, a LoRA adapter's id for its requests (their K/V differs). A new or preempted
request first takes the longest run of registered blocks matching its tokens
(``acquire_cached_prefix``) and computes only the rest. Blocks are reference
counted; a released block whose count drops to 0 stays registered in the free
pool, where it waits in least-recently-used order: allocation takes unregistered
blocks and the least recently released registered ones first, and forgets a
registered block's hash when it reuses it.

**The proposer's K/V in cached blocks** (``proposer_kv``). A proposer whose K/V
follows the target's block tables (a draft model, an EAGLE head) writes it in
the same slots, so a shared block can carry it too. Registration does not wait
for it; instead a registered block is marked once the proposer's K/V in it is
final (``cache_full_blocks``'s ``num_proposer_tokens``), and a hit tells how far
the proposer may start (``proposer_tokens_in_hit``). A registered block that
never got a mark (its request's proposer never ran there) gives its key up to a
block of the same tokens, computed by a later request, once that one is marked.

- ``"from_tokens"`` (a draft model: its K/V at a position reads the tokens up to
  it): a hit takes every matched block; the proposer starts after the leading
  marked ones and computes its own K/V over the rest from the tokens.
- ``"from_features"`` (an EAGLE head: its K/V at a position reads the target's
  hidden state there, which a hit does not compute, and the token after it): a
  mark also records the token that followed the block, which its last position
  read. A hit ends before the first matched block that is not marked, or at the
  first whose recorded token differs from the request's own: that block is
  copied into a block of the request's own, all but its last position
  (``take_pending_copies``: the engine copies the slots in every cache before
  the step's forward), and the request computes that position again, so the hit
  covers one token less (where no block is free for the copy, it ends a block
  earlier). The head starts at the hit.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


PROPOSER_KV_FROM_TOKENS = "from_tokens"         # a draft model's
PROPOSER_KV_FROM_FEATURES = "from_features"     # an EAGLE head's


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 proposer_kv: str | None = None):
        if num_blocks < 1:
            raise ValueError("the KV cache has no room for a single block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.proposer_kv: str | None = None   # cached blocks carry the proposer's K/V (module docstring)
        # Free blocks, the next one to reuse first (unregistered ones, then registered ones LRU).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._block_of_key: dict[tuple, int] = {}    # (parent hash, tokens) -> block
        self._key_of_block: dict[int, tuple] = {}
        self._chain: dict[str, list[int]] = {}     # per request: hashes of its first blocks, registered or found
        # proposer_kv: registered blocks whose proposer K/V is final -> the token after the block
        # (from_features) or None; per request, its table's blocks looked at for marks so far
        self._proposer_marks: dict[int, int | None] = {}
        self._marked: dict[str, int] = {}
        # from_features: per request, the copy its last hit block needs (source slots, destination
        # slots, the source block, referenced until the copy is taken)
        self._pending: dict[str, tuple[list[int], list[int], int]] = {}
        # Prefix cache counters (tokens), as vLLM counts them.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.set_proposer_kv(proposer_kv)

    def set_proposer_kv(self, proposer_kv: str | None) -> None:
        """How cached blocks carry the proposer's K/V (``Proposer.cached_kv``): set before any request."""
        if proposer_kv not in (None, PROPOSER_KV_FROM_TOKENS, PROPOSER_KV_FROM_FEATURES):
            raise ValueError(f"unknown proposer_kv {proposer_kv!r}")
        if self._tables:
            raise RuntimeError("the proposer's K/V mode is set before any request holds blocks")
        self.proposer_kv = proposer_kv if self.enable_prefix_caching else None
        # With or without caching, forks keep a block whose last slot reads the next token to one beam.
        self.proposer_kv_reads_next_token = proposer_kv == PROPOSER_KV_FROM_FEATURES

    def prefix_cache_stats(self) -> dict:
        """Prefix cache lookups since start-up, in tokens (vLLM's queries and hits)."""
        return {
            "enabled": self.enable_prefix_caching,
            "queries": self.num_queried_tokens,
            "hits": self.num_hit_tokens,
            "hit_rate": self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0,
        }

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in total; all or nothing."""
        table = self._tables.setdefault(request_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > len(self._free):
            if not table:
                del self._tables[request_id]
            return False
        for _ in range(max(missing, 0)):
            table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        self._forget(block)
        self._refs[block] = 1
        return block

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Give ``child_id`` (holding no blocks) the parent's full blocks below ``num_tokens`` (the
        positions whose target K/V the two share; their tokens may differ from there on) by
        reference (beam search: beams share their common prefix); -> the tokens shared, a multiple
        of the block size. Their K/V is final, so neither writes to them again; the caller
        allocates the child's other blocks and copies what it needs of the rest of the parent's
        (copy on write, done at the fork). Freeing either drops one reference.

        For a proposer whose K/V comes ``PROPOSER_KV_FROM_FEATURES`` (with or without prefix
        caching) a shared block must also end before ``num_tokens - 1``: the head's K/V at that
        position reads the token at ``num_tokens``, which differs by beam."""
        if self._tables.get(child_id):
            raise ValueError(f"request {child_id!r} already holds KV blocks")
        final = num_tokens - 1 if self.proposer_kv_reads_next_token else num_tokens
        shared = self._tables.get(parent_id, [])[: max(final, 0) // self.block_size]
        for block in shared:
            self._refs[block] += 1
        if shared:
            self._tables[child_id] = list(shared)
            self._chain[child_id] = list(self._chain.get(parent_id, []))[: len(shared)]
        return len(shared) * self.block_size

    def free(self, request_id: str) -> None:
        """Release a request's blocks; registered ones stay findable until reused."""
        self._chain.pop(request_id, None)
        self._marked.pop(request_id, None)
        pending = self._pending.pop(request_id, None)
        if pending is not None:      # never copied: the destination goes back with the table
            self._release(pending[2])
        # The tail first: a request's last blocks are the least likely to be shared.
        for block in reversed(self._tables.pop(request_id, [])):
            self._release(block)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None
            if block not in self._key_of_block:
                self._free.move_to_end(block, last=False)   # nothing to keep: reuse it first

    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    # ------------------------------------------------------------ prefix caching
    def acquire_cached_prefix(self, request_id: str, token_ids: Sequence[int], root: Hashable = None) -> int:
        """Give a request without blocks the longest registered prefix of ``token_ids`` under
        ``root`` (the first block's parent key: what else its K/V depends on, e.g. a LoRA adapter;
        None for the base model);
        -> the number of tokens it covers (a multiple of the block size, or one less where
        an EAGLE head's last block is copied; see the module docstring for ``proposer_kv``).
        At least one token is always left to compute: the step needs its logits."""
        if not self.enable_prefix_caching or self._tables.get(request_id):
            return 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        matched = list(self._matched_blocks(token_ids, max_blocks, root))
        copy_last = False
        if self.proposer_kv == PROPOSER_KV_FROM_FEATURES:   # its head cannot compute a cached position again
            matched = matched[: self._leading_marked([block for _, block in matched])]
            for i, (_, block) in enumerate(matched):   # a block's last position read the token after it
                if self._proposer_marks[block] != token_ids[(i + 1) * bs]:
                    matched, copy_last = matched[: i + 1], True
                    break
        table = [block for _, block in matched]
        for block in table:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        hit = len(table) * bs
        if copy_last:
            if self._free:   # the last block: a copy of the request's own, its last position computed again
                source = table[-1]
                table[-1] = self._take_free_block()
                self._pending[request_id] = ([source * bs + j for j in range(bs - 1)],
                                             [table[-1] * bs + j for j in range(bs - 1)], source)
                hit -= 1
            else:            # no block for the copy: the hit ends a block earlier
                self._release(table.pop())
                matched.pop()
                hit -= bs
        if table:
            self._tables[request_id] = table
            self._chain[request_id] = [hash(key) for key, _ in matched]
        return hit

    def _leading_marked(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks``, from the first, are marked (hold the proposer's final K/V)."""
        n = 0
        while n < len(blocks) and blocks[n] in self._proposer_marks:
            n += 1
        return n

    def marked_tokens(self, request_id: str) -> int:
        """Tokens in the leading blocks of the request's table that are marked: blocks whose
        proposer K/V some request has computed (at its hit, or since: a sibling sample's draft)."""
        return self._leading_marked(self._tables.get(request_id, [])) * self.block_size

    def proposer_tokens_in_hit(self, request_id: str, hit: int) -> int:
        """Of the ``hit`` tokens ``acquire_cached_prefix`` just gave the request, those whose
        proposer K/V came with them: where its proposer starts (0 without ``proposer_kv``). An
        EAGLE head's hit ends where its K/V does."""
        if self.proposer_kv == PROPOSER_KV_FROM_FEATURES:
            return hit
        return min(self.marked_tokens(request_id), hit)

    def take_pending_copies(self) -> tuple[list[int], list[int]]:
        """-> (source slots, destination slots) that requests admitted since the last call need
        copied, in every cache that follows these block tables, before any of them is computed
        (an EAGLE head's last hit block). The sources may be reused after this."""
        src: list[int] = []
        dst: list[int] = []
        for s, d, source in self._pending.values():
            src += s
            dst += d
            self._release(source)
        self._pending.clear()
        return src, dst

    def _matched_blocks(self, token_ids: Sequence[int], max_blocks: int, root: Hashable = None):
        """-> (key, block) of the registered blocks that match ``token_ids`` from its start under
        ``root``, at most ``max_blocks``."""
        bs, parent = self.block_size, root
        for i in range(max_blocks):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block = self._block_of_key.get(key)
            if block is None:
                return
            yield key, block
            parent = hash(key)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a request that could not be admitted
        looks again later, and is counted then)."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def cache_request_blocks(self, req, num_verified_tokens: int) -> None:
        """``cache_full_blocks`` for a ``core.request.Request``: its id, tokens, proposer count and cache
        root (its LoRA adapter), so no caller can leave one out."""
        self.cache_full_blocks(req.request_id, req.all_token_ids, num_verified_tokens, req.proposer_num_computed_tokens,
                               root=req.cache_root)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_verified_tokens: int,
                          num_proposer_tokens: int | None = None, root: Hashable = None) -> None:
        """Register the request's full blocks below ``num_verified_tokens`` (tokens
        whose KV is final; never a draft token awaiting verification). With ``proposer_kv``,
        mark its registered blocks below ``num_proposer_tokens`` too (the positions where the
        proposer's K/V is final: ``Request.proposer_num_computed_tokens``)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id, [])
        chain = self._chain.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(chain), min(num_verified_tokens // bs, len(table))):
            key = (chain[-1] if chain else root, tuple(token_ids[i * bs : (i + 1) * bs]))
            chain.append(hash(key))
            block = table[i]
            if key not in self._block_of_key and block not in self._key_of_block:
                self._block_of_key[key] = block
                self._key_of_block[block] = key
        if self.proposer_kv is not None:
            if num_proposer_tokens is None:
                raise ValueError("blocks that carry the proposer's K/V need its count of computed tokens")
            self._mark_proposer_kv(request_id, token_ids, min(num_verified_tokens, num_proposer_tokens) // bs)

    def _mark_proposer_kv(self, request_id: str, token_ids: Sequence[int], full: int) -> None:
        """Mark the request's registered blocks among its first ``full`` (an EAGLE head's: those
        whose next token is known, recorded with it). Where another block is registered under
        one's key without a mark (its request never ran the proposer there, so an EAGLE hit stops
        before it), this block takes the key over."""
        bs, table = self.block_size, self._tables.get(request_id, [])
        chain = self._chain.get(request_id, [])
        from_features = self.proposer_kv == PROPOSER_KV_FROM_FEATURES
        if from_features:
            full = min(full, (len(token_ids) - 1) // bs)
        start = self._marked.get(request_id, 0)
        for i in range(start, min(full, len(chain), len(table))):
            block = table[i]
            if block not in self._key_of_block:
                key = (chain[i - 1] if i else None, tuple(token_ids[i * bs : (i + 1) * bs]))
                other = self._block_of_key.get(key)
                if other is None or other in self._proposer_marks:
                    continue
                self._forget(other)
                self._block_of_key[key] = block
                self._key_of_block[block] = key
            if block not in self._proposer_marks:
                self._proposer_marks[block] = token_ids[(i + 1) * bs] if from_features else None
        self._marked[request_id] = max(start, min(full, len(table)))

    def cached_block_key(self, block: int) -> tuple | None:
        """(parent's hash, the block's tokens) a block is registered under; None if it is not."""
        return self._key_of_block.get(block)

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (their KV stays until overwritten)."""
        self._block_of_key.clear()
        self._key_of_block.clear()
        self._proposer_marks.clear()
        self._chain.clear()
        self._marked.clear()

    def _forget(self, block: int) -> None:
        key = self._key_of_block.pop(block, None)
        self._proposer_marks.pop(block, None)
        if key is not None:
            del self._block_of_key[key]
