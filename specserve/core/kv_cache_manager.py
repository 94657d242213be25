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
64-bit hashes are). A new or preempted
request first takes the longest run of registered blocks matching its tokens
(``acquire_cached_prefix``) and computes only the rest. Blocks are reference
counted; a released block whose count drops to 0 stays registered in the free
pool, where it waits in least-recently-used order: allocation takes unregistered
blocks and the least recently released registered ones first, and forgets a
registered block's hash when it reuses it.

**The proposer's K/V in cached blocks** (``with_proposer_kv``, EAGLE). A proposer
whose K/V follows the target's block tables writes it in the same slots, so a
shared block can carry it too, when it is final there: a block is then
registered only once the proposer has also computed all of its positions
(``cache_full_blocks``'s ``num_proposer_tokens``), and a hit starts the
proposer after the cached prefix. EAGLE's K/V at a position reads the token
after it, so a registered block also records the token that followed it (the
next block's first, which its last position read). A hit ends at the first
matched block whose recorded token differs from the request's own: that block
is copied into a block of the request's own, all but its last position
(``take_pending_copies``: the engine copies the slots in every cache before the
step's forward), and the request computes that position again, so the hit
covers one token less. Where no block is free for the copy, the hit ends a
block earlier.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 with_proposer_kv: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV cache has no room for a single block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.with_proposer_kv = with_proposer_kv     # cached blocks carry the proposer's K/V (module docstring)
        # Free blocks, the next one to reuse first (unregistered ones, then registered ones LRU).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._block_of_key: dict[tuple, int] = {}    # (parent hash, tokens) -> block
        self._key_of_block: dict[int, tuple] = {}
        self._next_token: dict[int, int] = {}        # with_proposer_kv: registered block -> the token after it
        self._chain: dict[str, list[int]] = {}     # per request: hashes of its first blocks, registered or found
        # with_proposer_kv: per request, the copy its last hit block needs (source slots, destination
        # slots, the source block, referenced until the copy is taken)
        self._pending: dict[str, tuple[list[int], list[int], int]] = {}
        # Prefix cache counters (tokens), as vLLM counts them.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

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
        """Give ``child_id`` (holding no blocks) the parent's full blocks below ``num_tokens`` by
        reference (beam search: beams share their common prefix); -> the tokens shared, a multiple
        of the block size. Their K/V is final, so neither writes to them again; the caller allocates
        the child's other blocks and copies what it needs of the parent's partial block (copy on
        write, done at the fork). Freeing either drops one reference."""
        if self._tables.get(child_id):
            raise ValueError(f"request {child_id!r} already holds KV blocks")
        shared = self._tables.get(parent_id, [])[: num_tokens // self.block_size]
        for block in shared:
            self._refs[block] += 1
        if shared:
            self._tables[child_id] = list(shared)
            self._chain[child_id] = list(self._chain.get(parent_id, []))[: len(shared)]
        return len(shared) * self.block_size

    def free(self, request_id: str) -> None:
        """Release a request's blocks; registered ones stay findable until reused."""
        self._chain.pop(request_id, None)
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
    def acquire_cached_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Give a request without blocks the longest registered prefix of ``token_ids``;
        -> the number of tokens it covers (a multiple of the block size, or one less where
        ``with_proposer_kv`` copies the last block, see the module docstring). At least one
        token is always left to compute: the step needs its logits."""
        if not self.enable_prefix_caching or self._tables.get(request_id):
            return 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        matched = list(self._matched_blocks(token_ids, max_blocks))
        copy_last = False
        if self.with_proposer_kv:   # the proposer's K/V at a block's last position read the token after it
            for i, (_, block) in enumerate(matched):
                if self._next_token[block] != token_ids[(i + 1) * bs]:
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

    def take_pending_copies(self) -> tuple[list[int], list[int]]:
        """-> (source slots, destination slots) that requests admitted since the last call need
        copied, in every cache that follows these block tables, before any of them is computed
        (``with_proposer_kv``: the last hit block's copy). The sources may be reused after this."""
        src: list[int] = []
        dst: list[int] = []
        for s, d, source in self._pending.values():
            src += s
            dst += d
            self._release(source)
        self._pending.clear()
        return src, dst

    def _matched_blocks(self, token_ids: Sequence[int], max_blocks: int):
        """-> (key, block) of the registered blocks that match ``token_ids`` from its start, at most
        ``max_blocks``."""
        bs, parent = self.block_size, None
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

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_verified_tokens: int,
                          num_proposer_tokens: int | None = None) -> None:
        """Register the request's full blocks below ``num_verified_tokens`` (tokens
        whose KV is final; never a draft token awaiting verification), and with
        ``with_proposer_kv`` below ``num_proposer_tokens`` too (the positions where the
        proposer's K/V is final: ``Request.proposer_num_computed_tokens``)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id, [])
        chain = self._chain.setdefault(request_id, [])
        bs = self.block_size
        full = num_verified_tokens // bs
        if self.with_proposer_kv:   # (and the token after the block is known: its record)
            if num_proposer_tokens is None:
                raise ValueError("blocks that carry the proposer's K/V need its count of computed tokens")
            full = min(full, num_proposer_tokens // bs, (len(token_ids) - 1) // bs)
        for i in range(len(chain), min(full, len(table))):
            key = (chain[-1] if chain else None, tuple(token_ids[i * bs : (i + 1) * bs]))
            chain.append(hash(key))
            block = table[i]
            if key not in self._block_of_key and block not in self._key_of_block:
                self._block_of_key[key] = block
                self._key_of_block[block] = key
                if self.with_proposer_kv:
                    self._next_token[block] = token_ids[(i + 1) * bs]

    def cached_block_key(self, block: int) -> tuple | None:
        """(parent's hash, the block's tokens) a block is registered under; None if it is not."""
        return self._key_of_block.get(block)

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (their KV stays until overwritten)."""
        self._block_of_key.clear()
        self._key_of_block.clear()
        self._next_token.clear()
        self._chain.clear()

    def _forget(self, block: int) -> None:
        key = self._key_of_block.pop(block, None)
        self._next_token.pop(block, None)
        if key is not None:
            del self._block_of_key[key]
