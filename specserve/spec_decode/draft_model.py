"""A draft model proposer: a smaller model with the target's vocabulary.

It has its own ModelRunner and KV cache tensors but shares the target's block
tables (same block ids, its own cache), so the scheduler's lookahead slots and
preemption cover it too. Each step it first catches up on every token it has
not seen (the prompt, and recovered / bonus tokens from the last verification)
and samples draft 1, then runs single-token steps for drafts 2..k, all without
going back to the scheduler. With ``draft_vocab_size`` its LM head covers only
the first token ids (``ParallelLMHead.keep_first_tokens``); the others get
probability 0 in the draft, which rejection sampling handles like any other
draft distribution, so the output stays the target's.
"""
from __future__ import annotations

import torch

from specserve.core.kv_cache_manager import KVCacheManager
from specserve.core.scheduler import ScheduledRequest
from specserve.sample.penalties import adjust_each_row
from specserve.sample.sampler import CHOICE, choose_tokens, keyed_generator
from specserve.spec_decode.proposer import Proposal, Proposer
from specserve.structured_output.rows import mask_draft_rows
from specserve.worker.model_runner import ForwardInput, ModelRunner


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, kv_cache: KVCacheManager, vocab_size: int):
        self.runner = runner
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        reqs = [s.request for s in scheduled]
        budgets = [s.num_lookahead for s in scheduled]
        params = [r.sampling_params for r in reqs]
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        # Step 1: catch up on unseen tokens; the last one's logits give draft 1.
        inputs = []
        for r in reqs:
            start = r.proposer_num_computed_tokens
            inputs.append(ForwardInput(r.all_token_ids[start:], start, self.kv_cache.block_table(r.request_id), 1))
        active = list(range(len(reqs)))
        for step in range(max(budgets)):
            logits = self.runner.execute(inputs).logits                         # [len(active), V or Vd]
            if logits.shape[1] < self.vocab_size:   # a reduced draft vocabulary: the rest is never proposed
                logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[1]), value=float("-inf"))
            logits = adjust_each_row(logits, [params[i] for i in active], [reqs[i].prompt_token_ids for i in active],
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
