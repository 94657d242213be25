"""A draft model proposer: a smaller model with the target's vocabulary.

It has its own ModelRunner and KV cache tensors but shares the target's block
tables (same block ids, its own cache), so the scheduler's lookahead slots and
preemption cover it too, and prefix caching shares its K/V along with the
target's (``cached_kv``: a hit skips the blocks where an earlier request's draft
computed its K/V). Each step it first catches up on every token it has
not seen (the prompt, and recovered / bonus tokens from the last verification)
and samples draft 1, then runs single-token steps for drafts 2..k, all without
going back to the scheduler. With ``draft_vocab_size`` its LM head covers only
the first token ids (``ParallelLMHead.keep_first_tokens``); the others get
probability 0 in the draft, which rejection sampling handles like any other
draft distribution, so the output stays the target's.

With a ``TreeConfig`` it proposes a tree instead (``draft_tree``): the catch-up forward
gives the root's distribution, then one batched tree-attention forward per depth.
"""
from __future__ import annotations

import torch

from specserve.config import TreeConfig
from specserve.core.kv_cache_manager import PROPOSER_KV_FROM_TOKENS, KVCacheManager
from specserve.core.request import Request
from specserve.core.scheduler import ScheduledRequest
from specserve.model_executor.layers.attention import cache_slot
from specserve.sample.penalties import adjust_request_rows
from specserve.sample.sampler import CHOICE, choose_tokens, keyed_generator
from specserve.spec_decode.draft_tree import DraftTreeGrower, TreeStep
from specserve.spec_decode.proposer import Proposal, Proposer, drafts_by_argmax
from specserve.structured_output.rows import mask_draft_rows
from specserve.worker.model_runner import ForwardInput, ModelRunner


class DraftModelProposer(Proposer):
    runs_beams = True     # its K/V follows the target's block tables
    cached_kv = PROPOSER_KV_FROM_TOKENS

    def __init__(self, runner: ModelRunner, kv_cache: KVCacheManager, vocab_size: int,
                 tree: TreeConfig | None = None, depth: int = 0):
        """``tree``: propose trees of drafts, ``depth`` deep unless ``tree.max_depth`` says."""
        self.runner = runner
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        self.tree = DraftTreeGrower(tree, depth, vocab_size) if tree is not None else None

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        if self.tree is not None:
            return self._propose_trees(scheduled)
        reqs = [s.request for s in scheduled]
        budgets = [s.num_lookahead for s in scheduled]
        params = [r.sampling_params for r in reqs]
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        # Step 1: catch up on unseen tokens; the last one's logits give draft 1.
        inputs = []
        for r in reqs:
            start = self._catch_up_start(r)
            inputs.append(ForwardInput(r.all_token_ids[start:], start, self.kv_cache.block_table(r.request_id), 1))
        active = list(range(len(reqs)))
        for step in range(max(budgets)):
            logits = self.runner.execute(inputs).logits                         # [len(active), V or Vd]
            if logits.shape[1] < self.vocab_size:   # a reduced draft vocabulary: the rest is never proposed
                logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[1]), value=float("-inf"))
            logits = adjust_request_rows(logits, [reqs[i] for i in active],
                                         [reqs[i].output_token_ids + drafts[i] for i in active])
            logits = mask_draft_rows(logits, [reqs[i] for i in active], [drafts[i] for i in active])   # grammars
            # Draft j guesses output token num_output_tokens + j with that token's own noise.
            generators = [keyed_generator(reqs[i].seed, reqs[i].num_output_tokens + len(drafts[i]), CHOICE,
                                          logits.device) for i in active]
            choice = choose_tokens(logits, [params[i] for i in active], generators)
            for row, i in enumerate(active):
                reqs[i].proposer_num_computed_tokens += len(inputs[row].token_ids)
                drafts[i].append(choice.tokens[row])
                if not params[i].greedy:
                    probs[i].append(choice.probs[row])                            # [V]
            # Next step: feed each new draft token to requests that want more.
            active = [i for i in active if len(drafts[i]) < budgets[i]]
            if step == 0 and active and self._greedy_chain(reqs, active, drafts, budgets):
                break
            inputs = [
                ForwardInput([drafts[i][-1]], reqs[i].proposer_num_computed_tokens,
                             self.kv_cache.block_table(reqs[i].request_id), 1)
                for i in active
            ]
            if not active:
                break
        return Proposal(
            token_ids=drafts,
            probs=[torch.stack(p) if p else None for p in probs],
        )

    def _greedy_chain(self, reqs: list[Request], active: list[int], drafts: list[list[int]], budgets: list[int]) -> bool:
        """Drafts 2.. of every active request in one captured graph (``StepGraphs.greedy_chain``:
        each argmax fed back on the device), where the runner has one for this batch and every
        active request drafts greedily with nothing adjusting or masking its logits; extends
        ``drafts`` and returns True, else False (the caller steps on)."""
        graphs = self.runner.graphs
        steps = [budgets[i] - len(drafts[i]) for i in active]
        bucket = graphs.chain_bucket(len(active), max(steps)) if graphs is not None else None
        if bucket is None or not all(drafts_by_argmax(reqs[i]) for i in active):
            return False
        tokens = graphs.greedy_chain(bucket, [drafts[i][-1] for i in active],
                                     [reqs[i].proposer_num_computed_tokens for i in active],
                                     [self.kv_cache.block_table(reqs[i].request_id) for i in active], steps)
        for i, n, new in zip(active, steps, tokens):
            drafts[i].extend(new)
            reqs[i].proposer_num_computed_tokens += n   # it fed drafts 1..n (the last one drafted is not fed)
        return True

    def _catch_up_start(self, r: Request) -> int:
        """Where the catch-up starts: after the positions the draft has computed for ``r``, or after
        the leading blocks of its table that hold the draft's K/V already, where a prefix cache
        hit shared blocks whose K/V another request's draft has computed since (a sibling sample's,
        say: ``KVCacheManager.marked_tokens``). Looked up only before a long catch-up."""
        start = r.proposer_num_computed_tokens
        if r.num_computed_tokens - start > self.kv_cache.block_size:
            start = max(start, min(self.kv_cache.marked_tokens(r.request_id), r.num_computed_tokens))
            r.proposer_num_computed_tokens = start
        return start

    def _propose_trees(self, scheduled: list[ScheduledRequest]) -> Proposal:
        """Catch up (the last token's logits are the root's), then grow each request's tree."""
        reqs = [s.request for s in scheduled]
        tables = [self.kv_cache.block_table(r.request_id) for r in reqs]
        inputs = []
        for r, table in zip(reqs, tables):
            start = self._catch_up_start(r)
            inputs.append(ForwardInput(r.all_token_ids[start:], start, table, 1))
        root_logits = self.runner.execute(inputs).logits                                # [B, V or Vd]
        for r, inp in zip(reqs, inputs):
            r.proposer_num_computed_tokens += len(inp.token_ids)

        def forward(steps: list[TreeStep]) -> torch.Tensor:
            return self.runner.execute([
                ForwardInput(st.token_ids, st.start_position, tables[st.index], len(st.token_ids),
                             tree_parents=st.span_parents, tree_cached=st.tree_cached)
                for st in steps]).logits                                                # [sum nodes, V or Vd]

        return self.tree.grow(reqs, [s.num_lookahead for s in scheduled], root_logits, forward)

    def copy_kv_slots(self, src: list[int], dst: list[int]) -> None:
        self.runner.copy_kv_slots(src, dst)

    def keep_tree_branch(self, request: Request, path: list[int], last: int) -> None:
        if self.tree is not None:
            table = self.kv_cache.block_table(request.request_id)
            self.tree.keep_branch(request, path, last, self.runner.copy_kv_slots,
                                  lambda position: cache_slot(table, position, self.runner.block_size))
