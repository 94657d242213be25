"""One engine step with everything but the engine scripted by the test: a fake target whose
logits the test chooses, and a proposer that drafts what the test tells it to.

The fake target (``FakeTarget``) is a tiny "model" with a KV cache of token ids: the logits
of a token depend on the token and on the one before it, and the one before the first new
token of a step is read from its cache slot. So a rollback that leaves the wrong count, or a
tree branch whose K/V is not moved into place, changes what comes next, exactly as it would
with a real model; and every expected token, source and log-probability is computed here
from the fake's definition, not taken from a plain run.
"""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model_executor.layers.attention import cache_slot
from specserve.spec_decode.proposer import Proposal, Proposer
from specserve.worker.model_runner import ForwardOutput

SUPPORT = 4                                  # a row's distribution covers 4 tokens
SUPPORT_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0])
PROMPT = [301, 302, 303, 304, 305, 306, 307, 308]
K = 4


def best(prev: int, token: int) -> int:
    """The fake target's most likely token after (prev, token); far from EOS and specials."""
    return 400 + (prev * 31 + token * 7 + 11) % 500


def logits_row(prev: int, token: int, vocab_size: int) -> torch.Tensor:
    """[V]: -inf except best(prev, token) .. + 3, in SUPPORT_LOGITS order."""
    row = torch.full((vocab_size,), float("-inf"))
    row[best(prev, token) : best(prev, token) + SUPPORT] = SUPPORT_LOGITS
    return row


def greedy_continuation(tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out.append(best(out[-2], out[-1]))
    return out[len(tokens):]


class FakeTarget:
    """Stands in for the target's ModelRunner: ``execute``, ``copy_kv_slots``, ``device``."""

    def __init__(self, vocab_size: int, block_size: int):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.device = torch.device("cpu")
        self.kv: dict[int, int] = {}          # cache slot -> the token id whose "K/V" it holds
        self.inputs: list[list] = []          # every execute's ForwardInputs
        self.copies: list[tuple[list[int], list[int]]] = []

    def execute(self, inputs, return_all_hidden: bool = False) -> ForwardOutput:
        self.inputs.append(inputs)
        rows = []
        for inp in inputs:
            toks, table, start = inp.token_ids, inp.block_table, inp.start_position
            parents = inp.tree_parents if inp.tree_parents is not None else list(range(-1, len(toks) - 1))
            before = self.kv[cache_slot(table, start - 1, self.block_size)] if start > 0 else 0
            for i, tok in enumerate(toks):
                self.kv[cache_slot(table, start + i, self.block_size)] = tok
            for i in range(len(toks) - inp.num_logits, len(toks)):
                prev = toks[parents[i]] if parents[i] >= 0 else before
                rows.append(logits_row(prev, toks[i], self.vocab_size))
        logits = torch.stack(rows) if rows else torch.empty(0, self.vocab_size)
        n = sum(len(i.token_ids) for i in inputs)
        return ForwardOutput(logits, torch.zeros(len(rows), 1), torch.zeros(n, 1) if return_all_hidden else None)

    def copy_kv_slots(self, src: list[int], dst: list[int]) -> None:
        self.copies.append((list(src), list(dst)))
        values = [self.kv[s] for s in src]
        for d, v in zip(dst, values):
            self.kv[d] = v


class ScriptedProposer(Proposer):
    """``script(request, num_lookahead) -> (draft tokens, parents or None)`` for each request."""

    def __init__(self, script):
        self.script = script

    def propose(self, scheduled) -> Proposal:
        drafts, parents = [], []
        for s in scheduled:
            tokens, tree = self.script(s.request, s.num_lookahead)
            drafts.append(tokens)
            parents.append(tree)
        return Proposal(drafts, [None] * len(scheduled), parents if any(p is not None for p in parents) else None)


def engine_with(tiny_llama_dir, script=None, **kw):
    kw = dict(dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20), **kw)
    proposer = ScriptedProposer(script) if script is not None else None
    spec = {"method": "ngram", "num_speculative_tokens": K} if script is not None else None
    engine = LLM(model=tiny_llama_dir, speculative_config=spec, proposer=proposer, **kw).engine
    engine.runner = FakeTarget(engine.vocab_size, engine.config.block_size)
    return engine


def run(engine, prompts, params) -> list:
    """Each request's final RequestOutput, in the order of ``prompts``."""
    ids = [engine.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    return [final[i] for i in ids]


def right(req, n):
    return greedy_continuation(req.all_token_ids, n)


def wrong(token: int) -> int:
    return 1000 + token % 100            # never a best() token (those are 400..903)


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# ---------------------------------------------------------------- chains: accepted, recovered, bonus
def per_step_plan(req, n):
    """By the request's decoding steps so far: all right (bonus), one right then a wrong one
    (recovered after one), a wrong first draft (recovered at once), no drafts (plain), repeat."""
    kind = (req.spec_stats.num_steps + 1) % 4
    truth = right(req, n)
    if kind == 1:
        return truth, None
    if kind == 2 and n >= 2:
        return truth[:1] + [wrong(truth[1])] + truth[2:], None
    if kind == 3:
        return [wrong(truth[0])] + truth[1:], None
    return [], None


def test_accepted_recovered_bonus_and_plain_tokens_follow_the_script(tiny_llama_dir):
    engine = engine_with(tiny_llama_dir, per_step_plan)
    req_id = engine.add_request(PROMPT, GREEDY)
    req = engine.requests[req_id]
    expected_sources = []
    steps = 0
    while engine.has_unfinished_requests():
        before = list(req.output_token_ids)
        kind = (req.spec_stats.num_steps + 1) % 4
        [out] = engine.step()
        steps += 1
        new = out.outputs[0].token_ids[len(before):]
        assert new == greedy_continuation(PROMPT + before, len(new))   # the fake target's own tokens
        if len(before) == 0:          # the prompt's prefill: no drafts
            step_sources = ["plain"]
        elif kind == 1:       # K drafts, fewer near max_tokens: all accepted, then the bonus
            assert len(new) == min(K, 12 - len(before) - 1) + 1
            step_sources = ["accepted"] * (len(new) - 1) + ["bonus"]
        elif kind == 2:
            step_sources = ["accepted", "recovered"]
        elif kind == 3:
            step_sources = ["recovered"]
        else:
            step_sources = ["plain"]
        expected_sources += step_sources[: len(new)]       # max_tokens may cut the last step short
        assert out.outputs[0].token_sources == expected_sources
        if not out.finished:
            # the rollback: every token but the last has K/V, rejected drafts' slots are given back
            assert req.num_computed_tokens == req.num_tokens - 1
            assert req.draft_token_ids == [] and req.draft_parents is None
    assert out.outputs[0].token_ids == greedy_continuation(PROMPT, 12)
    assert {"plain", "accepted", "recovered", "bonus"} <= set(expected_sources)
    assert steps < 12                      # speculation saved forward passes
    stats = engine.get_spec_decode_stats()
    assert stats.num_accepted_tokens == expected_sources.count("accepted")


def test_each_step_feeds_the_target_the_last_token_and_the_drafts_at_the_rolled_back_position(tiny_llama_dir):
    engine = engine_with(tiny_llama_dir, per_step_plan)
    [out] = run(engine, [PROMPT], GREEDY)
    tokens = PROMPT + out.outputs[0].token_ids
    for [inp] in engine.runner.inputs[1:]:       # after the prefill
        assert inp.token_ids[0] == tokens[inp.start_position]   # the last verified token, at its position
        assert inp.num_logits == len(inp.token_ids)              # logits for it and every draft


# ---------------------------------------------------------------- a tree whose second branch wins
def second_branch_right(req, n):
    """Root children: a wrong token (node 0) and the right chain (nodes 1..n-1)."""
    if req.num_output_tokens == 0 or n < 2:
        return [], None
    truth = right(req, n - 1)
    return [wrong(truth[0])] + truth, [-1, -1] + list(range(1, n - 1))


def test_an_accepted_second_branch_has_its_kv_moved_into_place(tiny_llama_dir):
    engine = engine_with(tiny_llama_dir, second_branch_right)
    [out] = run(engine, [PROMPT], GREEDY)
    assert out.outputs[0].token_ids == greedy_continuation(PROMPT, 12)
    assert "accepted" in out.outputs[0].token_sources and engine.runner.copies
    bs = engine.config.block_size
    # the first verification: last token at position 8; drafts in slots 9..12; path = nodes 1, 2, 3
    table = engine.runner.inputs[1][0].block_table
    src, dst = engine.runner.copies[0]
    assert src == [cache_slot(table, p, bs) for p in (10, 11, 12)]
    assert dst == [cache_slot(table, p, bs) for p in (9, 10, 11)]


def test_without_the_move_the_next_step_reads_the_wrong_kv(tiny_llama_dir, monkeypatch):
    """The fake target notices a missing K/V move: the check above is not vacuous."""
    engine = engine_with(tiny_llama_dir, second_branch_right)
    monkeypatch.setattr(engine.runner, "copy_kv_slots", lambda src, dst: None)
    [out] = run(engine, [PROMPT], GREEDY)
    assert out.outputs[0].token_ids != greedy_continuation(PROMPT, 12)


# ---------------------------------------------------------------- logprobs rows
def test_logprobs_are_those_of_the_row_that_chose_each_token(tiny_llama_dir):
    engine = engine_with(tiny_llama_dir, per_step_plan)
    [out] = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    tokens = PROMPT + out.outputs[0].token_ids
    assert len(out.outputs[0].logprobs) == 12
    for t, entry in enumerate(out.outputs[0].logprobs):
        pos = len(PROMPT) + t                      # the emitted token's position
        row = torch.log_softmax(logits_row(tokens[pos - 2], tokens[pos - 1], engine.vocab_size), dim=-1)
        chosen = tokens[pos]
        assert entry[chosen].logprob == pytest.approx(row[chosen].item(), abs=1e-6) and entry[chosen].rank == 1
        runner_up = best(tokens[pos - 2], tokens[pos - 1]) + 1
        assert entry[runner_up].rank == 2 and entry[runner_up].logprob == pytest.approx(row[runner_up].item(), abs=1e-6)


# ---------------------------------------------------------------- stop strings inside accepted drafts
def test_a_stop_string_inside_accepted_drafts_ends_the_request_there(tiny_llama_dir):
    def all_right(req, n):
        return (right(req, n), None) if req.num_output_tokens else ([], None)

    engine = engine_with(tiny_llama_dir, all_right)
    full = greedy_continuation(PROMPT, 5)           # prefill token, then 4 accepted drafts + bonus
    tok = engine.tokenizer
    stop = tok.decode([full[3]])                    # the third accepted draft's text
    assert stop.strip() and stop not in tok.decode(full[:3])
    [out] = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.token_ids == full[:4]         # what followed the stop in the same step is dropped
    assert completion.text == tok.decode(full[:3])
    assert completion.token_sources == ["plain", "accepted", "accepted", "accepted"]
    assert engine.kv_cache.num_used_blocks() == 0 and not engine.requests


# ---------------------------------------------------------------- preemption of requests with drafts
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_preempted_requests_with_drafts_recompute_and_keep_the_scripted_output(tiny_llama_dir, prefix_caching):
    # 7 blocks of 16 tokens for three requests of up to 24 prompt + 24 output + 4 lookahead tokens
    prompts = [[310 + i * 17 + j for j in range(24)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = engine_with(tiny_llama_dir, per_step_plan, kv_cache_memory=7 * 8192, max_model_len=64,
                         enable_prefix_caching=prefix_caching)
    assert engine.kv_cache.num_blocks == 7
    if not prefix_caching:   # a freed block's K/V is gone (another request may overwrite it at once)
        free, fake, bs = engine.kv_cache.free, engine.runner, engine.config.block_size

        def free_and_forget(request_id):
            for block in engine.kv_cache.block_table(request_id):
                for slot in range(block * bs, (block + 1) * bs):
                    fake.kv.pop(slot, None)
            free(request_id)

        engine.kv_cache.free = free_and_forget
    outs = run(engine, prompts, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == greedy_continuation(p, 24)


# ---------------------------------------------------------------- a mixed batch
def drafts_for_even_prompts(req, n):
    if req.prompt_token_ids[0] % 2 or req.num_output_tokens == 0 or n < 3:
        return [], None
    truth = right(req, n)
    return truth[:2] + [wrong(truth[2])] + truth[3:], None


def test_a_batch_mixing_greedy_sampled_drafted_and_undrafted_requests(tiny_llama_dir):
    prompts = [[320 + i] + PROMPT for i in range(4)]          # 320, 322 drafted; 321, 323 not
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sampled = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7 + i) for i in range(4)]
    params = [greedy, greedy, sampled[2], sampled[3]]
    outs = run(engine_with(tiny_llama_dir, drafts_for_even_prompts), prompts, params)
    for p, o in zip(prompts[:2], outs[:2]):
        assert o.outputs[0].token_ids == greedy_continuation(p, 10)
    assert set(outs[0].outputs[0].token_sources) >= {"accepted", "recovered"}
    assert set(outs[1].outputs[0].token_sources) == {"plain"}
    for p, o in zip(prompts[2:], outs[2:]):                # every sampled token is in its row's support
        tokens = p + o.outputs[0].token_ids
        for pos in range(len(p), len(tokens)):
            assert 0 <= tokens[pos] - best(tokens[pos - 2], tokens[pos - 1]) < SUPPORT
    # Each request's tokens are its own: alone, with the same seed and drafts, it gets the same.
    for i in range(4):
        [alone] = run(engine_with(tiny_llama_dir, drafts_for_even_prompts), [prompts[i]], params[i])
        assert alone.outputs[0].token_ids == outs[i].outputs[0].token_ids
    # The undrafted sampled request draws exactly what plain decoding draws.
    [plain] = run(engine_with(tiny_llama_dir), [prompts[3]], params[3])
    assert plain.outputs[0].token_ids == outs[3].outputs[0].token_ids
