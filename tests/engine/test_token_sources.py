"""How each emitted token came (``CompletionOutput.token_sources``): plain decoding,
accepted drafts, the target's correction at a rejection, the bonus token; and that the
sources add up to the speculation stats. Tiny random models."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.sample.verify import ends_at_leaf
from specserve.outputs import TOKEN_SOURCES, step_token_sources

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [300 + (i % 7) for i in range(30)]
K = 3


def _llm(target, **spec):
    return LLM(model=target, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
               speculative_config=spec or None)


def steps_of(sources: list[str]) -> list[list[str]]:
    """Split the sources after the first (prefill) token into verification steps:
    each ends at a plain, recovered or bonus token (the last one may be cut short)."""
    steps, current = [], []
    for s in sources[1:]:
        current.append(s)
        if s != "accepted":
            steps.append(current)
            current = []
    if current:
        steps.append(current)
    return steps


def test_step_sources_for_chains():
    assert step_token_sources(0, 0, True) == ["plain"]
    assert step_token_sources(3, 1, False) == ["accepted", "recovered"]
    assert step_token_sources(3, 0, False) == ["recovered"]
    assert step_token_sources(3, 3, True) == ["accepted"] * 3 + ["bonus"]


class _TreeRequest:
    def __init__(self, drafts, parents):
        self.draft_token_ids, self.draft_parents = drafts, parents


def test_tree_sources_bonus_only_at_a_leaf():
    # Tree: 0 and 1 hang off the last token, 2 below 0; 1 is a leaf.
    req = _TreeRequest([5, 6, 7], [-1, -1, 0])
    assert ends_at_leaf(req, 2, [0, 2])          # down to leaf 2: the next token is a bonus
    assert ends_at_leaf(req, 1, [1])             # leaf 1
    assert not ends_at_leaf(req, 1, [0])         # stopped at 0, whose child 2 was rejected
    assert not ends_at_leaf(req, 0, [])          # both children of the root rejected
    assert ends_at_leaf(_TreeRequest([5, 6], None), 2, None)
    assert not ends_at_leaf(_TreeRequest([5, 6], None), 1, None)


def test_plain_decoding_is_all_plain(tiny_llama_dir):
    out = _llm(tiny_llama_dir).generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.token_sources == ["plain"] * len(completion.token_ids) == ["plain"] * 12


def test_a_draft_equal_to_the_target_is_always_accepted(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, method="draft_model", model=tiny_llama_dir, num_speculative_tokens=K)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1 + 4 * (K + 1), ignore_eos=True), use_tqdm=False)
    sources = out[0].outputs[0].token_sources
    assert sources == ["plain"] + (["accepted"] * K + ["bonus"]) * 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sources_follow_the_steps_and_add_up_to_the_stats(tiny_llama_dir, tiny_draft_dir, temperature):
    llm = _llm(tiny_llama_dir, method="draft_model", model=tiny_draft_dir, num_speculative_tokens=K)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=temperature, seed=3)
    out = llm.generate([PROMPT, PROMPT[:20]], params, use_tqdm=False)
    kinds = set()
    for o in out:
        completion, stats = o.outputs[0], o.spec_decode_stats
        sources = completion.token_sources
        assert len(sources) == len(completion.token_ids) and set(sources) <= set(TOKEN_SOURCES)
        assert sources[0] == "plain"
        steps = steps_of(sources)
        for step in steps[:-1]:
            accepted = step.count("accepted")
            assert step[-1] == ("bonus" if accepted == K else "recovered"), step
        kinds |= set(sources)
        # Every drafted step but a last one cut by max_tokens shows its final token.
        num_accepted = sources.count("accepted")
        closed = sources.count("recovered") + sources.count("bonus")
        assert stats.num_drafts - closed in (0, 1)
        assert 0 <= stats.num_accepted_tokens - num_accepted <= K
        assert stats.num_emitted_tokens >= len(sources) - 1
    assert {"accepted", "recovered"} <= kinds, kinds


def test_ngram_steps_without_a_match_are_plain(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, method="ngram", num_speculative_tokens=K)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    completion, stats = out[0].outputs[0], out[0].spec_decode_stats
    no_draft_steps = stats.steps_by_draft_length[0] if stats.steps_by_draft_length else 0
    assert completion.token_sources.count("plain") == 1 + no_draft_steps


def test_each_of_n_samples_has_its_own_sources(tiny_llama_dir, tiny_draft_dir):
    llm = _llm(tiny_llama_dir, method="draft_model", model=tiny_draft_dir, num_speculative_tokens=K)
    out = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=16, ignore_eos=True, temperature=1.0, seed=5),
                       use_tqdm=False)[0]
    for completion in out.outputs:
        assert len(completion.token_sources) == len(completion.token_ids) == 16
        assert completion.spec_decode_stats is not None
        assert completion.spec_decode_stats.num_accepted_tokens >= completion.token_sources.count("accepted")
    assert sum(c.spec_decode_stats.num_drafts for c in out.outputs) == out.spec_decode_stats.num_drafts
