"""What the dynamic_k engine tests share: a tiny engine's settings, prompts that repeat
themselves (so n-gram lookup finds proposals), a bare request, pinned forward costs, and the
catch-up counts a proposer reports."""
from __future__ import annotations

from specserve import LLM, SamplingParams
from specserve.core.request import Request

TINY_ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
REPEATING_PROMPTS = ["one two three one two three one two", "a b c a b c a b", "the cat sat on the mat the cat"]


def bare_request(tokens: list[int]) -> Request:
    return Request("r", None, tokens, SamplingParams(max_tokens=8), None, None)


def pin_forward_costs(llm: LLM, seconds_by_rows: dict[int, float]) -> None:
    """Pin the policy's forward costs (the engine's own timings are then ignored)."""
    policy = llm.engine.k_policy
    policy.forward.shape, policy.forward.seconds = {}, dict(seconds_by_rows)
    policy.record_forward = lambda rows, seconds: None
    policy.overhead_seconds, policy.record_overhead = 0.0, lambda seconds: None


def catch_up_counts(llm: LLM, monkeypatch, prompt: str, max_tokens: int) -> list[tuple[int, int]]:
    """(the request's tokens, ``Proposer.catch_up_tokens``) at each proposal of one greedy request."""
    proposer, seen = llm.engine.proposer, []
    real = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda scheduled: seen.append(
        (scheduled[0].request.num_tokens, proposer.catch_up_tokens(scheduled[0].request))) or real(scheduled))
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return seen
