"""A draft model whose tokenizer differs from the target's, lossless (Timor et al., ICML 2025,
"Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous
Vocabularies").

The draft reads each request's text in its own tokens (``draft_text.DraftSequence``: the
target's tokens as bytes, tokenized again for the draft, its KV cache rolled back to the
tokens it still shares with the target's text) and proposes TARGET tokens, by one of two
methods (``SpeculativeConfig.cross_vocab``):

- ``"slem"``, string-level exact match: the draft writes up to k + 1 tokens of its own
  vocabulary; their text is tokenized with the target's tokenizer, and the target tokens
  it spells are proposed one-hot, all but the last: the last may still change when more
  text follows (the draft's ``Hel`` then ``lo`` is the target's ``Hello``), so a draft text
  that ends inside a target token is held back, never verified half-way. One-hot drafts are
  verified by the target's own choice at every position (``sample.verify``): greedy output
  is the plain output, and sampled output has the target's distribution, since a one-hot
  draft x is accepted exactly when the target's sample is x (probability p(x), as rejection
  sampling with q = one-hot would accept it). Lossless at every temperature.
- ``"tli"``, token-level intersection: the draft's logits are kept only for its tokens that
  have a twin in the target's vocabulary (same bytes; ``vocab_map``), moved to the twins'
  target ids, and everything else is -inf; the target's sampling processing (temperature,
  top-k/p, min-p, penalties, a grammar's mask) then runs on that row as on any draft's,
  and the draft token is drawn from it. The draft's distribution q is thus a distribution
  over target tokens, and the proposal carries it: rejection sampling with the draft's
  probabilities accepts x with min(1, p(x)/q(x)) and recovers from max(0, p - q), which
  keeps the target's distribution exactly at every temperature. Each draft token is one
  target token, so nothing is held back.

The draft's KV cache is its own (``KVCacheManager`` blocks of its own, not the target's
block tables): its token count differs from the target's. Blocks of finished requests go
back when the request is garbage collected; when the pool runs out, requests outside the
step lose their cached draft KV (recomputed when they next draft). The target's preemption
leaves the draft's cache alone, and its prefix cache does not cover the draft (a new request's
prompt is read by the draft once, at its first draft).
"""
from __future__ import annotations

import itertools
import logging
import weakref

import torch

from specserve.config import SpeculativeConfig
from specserve.core.kv_cache_manager import KVCacheManager
from specserve.core.request import Request
from specserve.core.scheduler import ScheduledRequest
from specserve.model_executor.layers.attention import cache_slot
from specserve.sample.penalties import adjust_request_rows
from specserve.sample.sampler import CHOICE, choose_tokens, keyed_generator
from specserve.spec_decode.draft_text import SPECIAL_BASE, DraftSequence, draft_symbols, target_symbols
from specserve.spec_decode.proposer import Proposal, Proposer
from specserve.spec_decode.token_table import TokenText
from specserve.spec_decode.vocab_map import VocabMapping
from specserve.structured_output.rows import mask_draft_rows
from specserve.worker.model_runner import ForwardInput

logger = logging.getLogger(__name__)

METHODS = SpeculativeConfig.CROSS_VOCAB_METHODS     # ("slem", "tli")
# The default, by measurement (docs/speculative_decoding.md, "Drafts with another tokenizer"): TLI
# was as fast as SLEM or faster in every greedy cell (SLEM's higher tau costs a draft step more
# per proposal) and faster at temperature 0.7, where rejection sampling with the draft's
# probabilities accepts more than a one-hot draft.
DEFAULT_METHOD = "tli"
# SLEM drafts this many tokens more than the target tokens it may propose: the text's last
# target token is held back until the draft writes past it.
SLEM_EXTRA_STEPS = 1


class _Slot:
    """A request's draft sequence and the key of its draft KV blocks."""

    def __init__(self, seq: DraftSequence, key: str):
        self.seq = seq
        self.key = key
        self.last_used = 0


class CrossVocabProposer(Proposer):
    # Its KV blocks and draft text are its own, per request object: a forked beam gets a copy of
    # its parent's (``fork``: the full blocks shared, the partial one copied), or, where the
    # draft's pool has no room, reads its context into the draft again at its first draft.
    runs_beams = True
    # TLI reads the draft's logits of shared tokens only, so its draft's LM head is cut to those
    # rows (``compute_shared_rows_only``); tests that need the whole row turn this off.
    CUT_DRAFT_HEAD = True

    def __init__(self, runner, mapping: VocabMapping, method: str, target_tokenizer, draft_tokenizer,
                 num_blocks: int, block_size: int, max_len: int):
        if method not in METHODS:
            raise ValueError(f"unknown cross-vocabulary method {method!r}; choose one of {list(METHODS)}")
        self.runner = runner
        self.mapping = mapping
        self.method = method
        self.twins = mapping.same_tokens
        self.identical = mapping.identical          # (properties that compare whole vocabularies: once)
        self.target_text = TokenText(target_tokenizer, mapping.target)
        self.draft_text = TokenText(draft_tokenizer, mapping.draft)
        self.blocks = KVCacheManager(num_blocks, block_size)
        self.max_len = max_len                      # the draft runner's positions
        self.target_vocab = mapping.target.size
        self.draft_vocab = mapping.draft.size
        pairs = [(d, t) for d, t in enumerate(mapping.draft_to_target) if t >= 0]
        self.shared_draft = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=runner.device)   # [S]
        self.shared_target = torch.tensor([t for _, t in pairs], dtype=torch.long, device=runner.device)  # [S]
        self.head_is_shared = False                 # the draft's logits: all its ids, or shared_draft's only
        self._slots: weakref.WeakKeyDictionary[Request, _Slot] = weakref.WeakKeyDictionary()
        self._released: list[str] = []             # keys of collected requests' blocks (a finalizer's list)
        self._keys = itertools.count()
        self._step = 0
        self.num_evictions = 0                      # requests whose draft KV went to make room

    def compute_shared_rows_only(self, lm_head) -> bool:
        """Cut the draft's LM head (``ParallelLMHead``, TP 1) to its tokens with a target twin, so a
        draft step computes only the logits TLI reads: column j becomes ``shared_draft[j]``. Exact:
        each logit is its own row's dot product, the others were -inf in ``target_logits`` anyway.
        Pays where the draft's vocabulary is large next to its layers (Gemma 3 270M: 262,144 rows of
        640). False (nothing cut) for SLEM, which drafts from the whole vocabulary, or identical ones."""
        if self.method != "tli" or self.identical or not self.CUT_DRAFT_HEAD:
            return False
        inside = self.shared_draft < lm_head.vocab_size          # a reduced draft vocabulary keeps fewer
        try:
            lm_head.keep_tokens(self.shared_draft[inside])
        except ValueError as e:   # blocks of several formats, say: the whole head stays, as before
            logger.info("draft LM head kept whole: %s", e)
            return False
        self.shared_draft, self.shared_target = self.shared_draft[inside], self.shared_target[inside]
        self.head_is_shared = True
        logger.info("draft LM head cut to the %d tokens with a target twin (of %d)", self.shared_draft.numel(),
                    self.draft_vocab)
        return True

    # ------------------------------------------------------------------ requests' state
    def _slot(self, request: Request) -> _Slot:
        slot = self._slots.get(request)
        if slot is None:
            slot = _Slot(DraftSequence(self.mapping, self.draft_text, self.twins), f"draft-{next(self._keys)}")
            self._slots[request] = slot
            weakref.finalize(request, self._released.append, slot.key)   # list.append: safe from any thread
        slot.last_used = self._step
        return slot

    def catch_up_tokens(self, request: Request) -> int:
        """The request's target tokens its draft reading has not synced yet (all of them before
        its first proposal): an estimate of the draft tokens it will read, as the two tokenizers
        cut text about alike."""
        slot = self._slots.get(request)
        return request.num_tokens - (len(slot.seq.target_ends) if slot is not None else 0)

    def fork(self, parent: Request, child: Request, path: list[int], last: int) -> None:
        """The child's draft reading starts as its parent's: the text the parent had when it last
        drafted (the child's tokens continue it), its draft tokens and their K/V (full blocks by
        reference, the partial block copied). ``sync`` then rolls it back to what the child's text
        shares with the parent's drafts, as after a rejection."""
        slot = self._slots.get(parent)
        computed = slot.seq.num_computed if slot is not None else 0
        if computed == 0 or not self.blocks.block_table(slot.key):
            return
        own = self._slot(child)
        seq = slot.seq.copy()
        shared = self.blocks.fork(slot.key, own.key, computed)
        if not self.blocks.allocate_slots(own.key, computed):
            self.blocks.free(own.key)          # no room: the child reads its context again when it drafts
            return
        parent_table, child_table = self.blocks.block_table(slot.key), self.blocks.block_table(own.key)
        bs = self.blocks.block_size
        if computed > shared:
            self.runner.copy_kv_slots([cache_slot(parent_table, p, bs) for p in range(shared, computed)],
                                      [cache_slot(child_table, p, bs) for p in range(shared, computed)])
        own.seq = seq

    def _free_released(self) -> None:
        while self._released:
            self.blocks.free(self._released.pop())

    def _make_room(self, slot: _Slot, num_tokens: int, busy: set[str]) -> bool:
        """Blocks for ``num_tokens`` draft positions; the least recently drafting requests outside
        this step give theirs up (their draft KV is recomputed when they draft again)."""
        if self.blocks.allocate_slots(slot.key, num_tokens):
            return True
        idle = sorted((s for s in self._slots.values() if s.key not in busy and self.blocks.block_table(s.key)),
                      key=lambda s: s.last_used)
        for other in idle:
            self.blocks.free(other.key)
            other.seq.num_computed = 0
            self.num_evictions += 1
            if self.blocks.allocate_slots(slot.key, num_tokens):
                return True
        return False

    # ------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        self._step += 1
        self._free_released()
        reqs = [s.request for s in scheduled]
        slots = [self._slot(r) for r in reqs]
        try:
            return self._propose(scheduled, reqs, slots)
        except BaseException:
            for slot in slots:             # their cache may be half-written: read everything again
                slot.seq.num_computed = 0
            raise

    def _propose(self, scheduled, reqs, slots) -> Proposal:
        budgets = [s.num_lookahead for s in scheduled]
        steps = [b + SLEM_EXTRA_STEPS if self.method == "slem" else b for b in budgets]
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        busy = {slot.key for slot in slots}
        inputs, active = [], []
        for i, (r, slot) in enumerate(zip(reqs, slots)):
            seq = slot.seq
            seq.sync(r.all_token_ids)
            if budgets[i] <= 0 or not seq.ids or len(seq.ids) + steps[i] > self.max_len \
                    or not self._make_room(slot, len(seq.ids) + steps[i], busy):
                continue
            start = min(seq.num_computed, len(seq.ids) - 1)   # at least the last token: its logits are draft 1's
            inputs.append(ForwardInput(seq.ids[start:], start, self.blocks.block_table(slot.key), 1))
            active.append(i)
        step = 0
        while active:
            logits = self.runner.execute(inputs).logits   # [len(active), V_draft or fewer; S if head_is_shared]
            # a reduced draft vocabulary (draft_vocab_size): the rest is never drafted
            if not self.head_is_shared and logits.shape[1] < self.draft_vocab:
                logits = torch.nn.functional.pad(logits, (0, self.draft_vocab - logits.shape[1]), value=float("-inf"))
            for row, i in enumerate(active):
                slots[i].seq.num_computed = inputs[row].start_position + len(inputs[row].token_ids)
            if self.method == "tli":
                done = self._tli_step(logits, active, reqs, slots, drafts, probs)
            else:
                done = self._slem_step(logits, active, reqs, slots, drafts, budgets, step)
            step += 1
            active = [i for i in active if i not in done and step < steps[i]]
            inputs = [ForwardInput([slots[i].seq.ids[-1]], len(slots[i].seq.ids) - 1,
                                   self.blocks.block_table(slots[i].key), 1) for i in active]
        if self.method == "slem":
            drafts = [d[:b] for d, b in zip(drafts, budgets)]
        return Proposal(token_ids=drafts, probs=[torch.stack(p) if p else None for p in probs])

    def _slem_step(self, logits, active, reqs, slots, drafts, budgets, step) -> set[int]:
        """The draft's own next token for each active request, then the target tokens its text
        spells so far (``slem_tokens``) -> the requests that are done."""
        params = [reqs[i].sampling_params for i in active]
        generators = [keyed_generator(reqs[i].seed, reqs[i].num_output_tokens + step, CHOICE, logits.device)
                      for i in active]
        tokens = choose_tokens(logits, params, generators).tokens
        done = set()
        for i, token in zip(active, tokens):
            seq = slots[i].seq
            symbols = draft_symbols(self.mapping, token)
            final = symbols is None or symbols[-1] >= SPECIAL_BASE   # a special token ends the draft's text
            if symbols is not None:
                seq.push_draft(token, symbols)
            drafts[i] = slem_tokens(seq.drafted, final, self.target_text)
            if final or len(drafts[i]) >= budgets[i]:
                done.add(i)
        return done

    def _tli_step(self, logits, active, reqs, slots, drafts, probs) -> set[int]:
        """The draft's distribution on its tokens with target twins, as target ids; a token drawn
        from it (its probabilities kept for rejection sampling) -> the requests that are done."""
        rows = self.target_logits(logits)                                      # [len(active), V_target]
        params = [reqs[i].sampling_params for i in active]
        rows = adjust_request_rows(rows, [reqs[i] for i in active],
                                   [reqs[i].output_token_ids + drafts[i] for i in active])
        rows = mask_draft_rows(rows, [reqs[i] for i in active], [drafts[i] for i in active])   # grammars
        # Draft j guesses output token num_output_tokens + j with that token's own noise (as the
        # same-vocabulary draft model does): each TLI draft is exactly one target token.
        generators = [keyed_generator(reqs[i].seed, reqs[i].num_output_tokens + len(drafts[i]), CHOICE,
                                      logits.device) for i in active]
        choice = choose_tokens(rows, params, generators)
        done = set()
        for row, (i, token) in enumerate(zip(active, choice.tokens)):
            twin = token if self.identical else self.mapping.target_to_draft[token]
            drafts[i].append(token)
            if not params[row].greedy:
                probs[i].append(choice.probs[row])                             # [V_target]
            slots[i].seq.push_draft(twin, target_symbols(self.mapping, token))
            if self.mapping.target.pieces[token] is None:   # a special (EOS): nothing follows it
                done.add(i)
        return done

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[R, V_draft] (or [R, S] shared tokens only: ``head_is_shared``) -> [R, V_target]: each shared
        token's logit at its target twin, -inf elsewhere (identical vocabularies: the same row, an id
        is the same token in both)."""
        if self.identical:
            return draft_logits
        out = draft_logits.new_full((draft_logits.shape[0], self.target_vocab), float("-inf"))
        shared = draft_logits if self.head_is_shared else draft_logits.index_select(1, self.shared_draft)   # [R, S]
        out[:, self.shared_target] = shared
        return out


def slem_tokens(drafted: list[int], final: bool, target_text: TokenText) -> list[int]:
    """The target tokens that spell the draft's text ``drafted`` (symbols), in the target's
    tokenization; the last one left out unless the text is ``final`` (it may still change), and
    nothing from a byte the target cannot spell on (the text before it is complete)."""
    out: list[int] = []
    run_start = 0
    for i, s in enumerate(drafted + [None]):
        if s is not None and s < SPECIAL_BASE:
            continue
        run = bytes(drafted[run_start:i])
        spans = target_text.spans(run)
        complete = [t for t, _ in _contiguous(spans, target_text)]
        if len(complete) < len(spans) or (s is None and not final):
            return out + (complete if len(complete) < len(spans) else complete[:-1])
        out += complete
        if s is not None:
            out.append(s - SPECIAL_BASE)          # a special: the text before it is complete
        run_start = i + 1
    return out


def _contiguous(spans: list[tuple[int, int]], target_text: TokenText) -> list[tuple[int, int]]:
    """The spans up to the first byte left out."""
    out, at = [], 0
    for token, end in spans:
        if end - len(target_text.table.pieces[token]) != at:
            break
        out.append((token, end))
        at = end
    return out
