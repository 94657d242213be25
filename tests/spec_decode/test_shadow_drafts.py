"""Scoring a free proposer's proposals against the tokens the target emitted, and dynamic_k's
propose-then-trim path for such proposers: no probes, every proposal teaches the policy, and
the verified part is what the measured costs pay for."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.core.request import RequestStatus
from specserve.spec_decode.shadow_drafts import ShadowDrafts, gains_by_node, tree_depth

from dynamic_k_setup import REPEATING_PROMPTS as PROMPTS
from dynamic_k_setup import TINY_ENGINE_KW as KW
from dynamic_k_setup import bare_request, pin_forward_costs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_chain_earns_its_matching_prefix():
    assert gains_by_node([5, 6, 7], None, [5, 6, 9]) == [1, 1, 0]
    assert gains_by_node([5, 6, 7], None, [4, 6, 7]) == [0, 0, 0]     # nothing after a miss counts
    assert gains_by_node([5, 6, 7], None, [5]) == [1, 0, 0]           # never emitted: earned nothing


def test_a_tree_earns_the_branch_the_target_followed():
    tokens, parents = [5, 8, 6, 9, 7], [-1, -1, 0, 1, 2]              # two branches: 5-6-7 and 8-9
    assert gains_by_node(tokens, parents, [8, 9, 1]) == [0, 1, 0, 1, 0]
    assert gains_by_node(tokens, parents, [5, 6, 7]) == [1, 0, 1, 0, 1]
    assert gains_by_node(tokens, parents, [3]) == [0] * 5
    assert tree_depth(parents, 5) == 3 and tree_depth(parents, 2) == 1 and tree_depth(None, 4) == 4


def test_proposals_are_scored_once_decided():
    shadows, req = ShadowDrafts(), bare_request([1, 2, 3])
    shadows.remember(req, [4, 5, 6], None)          # guesses positions 3, 4, 5
    req.append_token(4)
    shadows.score(req)
    assert shadows.of(req, 3).proposed == []         # 4 matches; 5 and 6 still open
    req.append_token(5)
    shadows.remember(req, [7], None)                 # guesses position 5 (a second, overlapping proposal)
    req.append_token(9)
    shadows.score(req)
    assert (shadows.of(req, 3).proposed, shadows.of(req, 3).gained) == ([1, 1, 1], [1, 1, 0])
    assert (shadows.of(req, 1).proposed, shadows.of(req, 1).gained) == ([1], [0])
    assert shadows.engine(3).rates() == [1.0, 1.0, 0.0]


def test_a_miss_decides_early_and_a_finished_request_decides_everything():
    shadows, req = ShadowDrafts(), bare_request([1])
    shadows.remember(req, [2, 3, 4, 5], None)
    req.append_token(7)                              # misses at once: final with 1 token
    shadows.score(req)
    assert shadows.of(req, 4).gained == [0, 0, 0, 0]
    shadows.remember(req, [8, 9], None)
    req.append_token(8)
    req.status = RequestStatus.FINISHED_LENGTH       # 9 is never emitted
    shadows.score(req)
    assert shadows.of(req, 2).gained == [1, 0]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_free_rows_verify_every_proposal_as_a_fixed_k_does(tiny_llama_dir, method):
    """Rows that cost nothing: each proposal is kept whole, so the steps are those of a fixed k."""
    spec = {"method": method, "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fixed = LLM(model=tiny_llama_dir, **KW, speculative_config=spec)
    fixed_out = [o.outputs[0].token_ids for o in fixed.generate(PROMPTS, params, use_tqdm=False)]
    dynamic = LLM(model=tiny_llama_dir, **KW, speculative_config={**spec, "dynamic_k": True})
    pin_forward_costs(dynamic, {1: 0.01, 64: 0.01})
    assert [o.outputs[0].token_ids for o in dynamic.generate(PROMPTS, params, use_tqdm=False)] == fixed_out
    a, b = fixed.get_spec_decode_stats(), dynamic.get_spec_decode_stats()
    assert a.num_draft_tokens > 0
    assert (b.num_draft_tokens, b.num_accepted_tokens, b.num_steps) == (a.num_draft_tokens, a.num_accepted_tokens,
                                                                        a.num_steps)


def test_costly_rows_verify_nothing_yet_every_proposal_is_scored(tiny_llama_dir):
    """Each extra row costs a whole step: no draft is verified, with no probe either, while
    the proposals' acceptance is still learned from the emitted tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": True}
    plain = LLM(model=tiny_llama_dir, **KW)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(model=tiny_llama_dir, **KW, speculative_config=spec)
    pin_forward_costs(llm, {1: 0.01, 2: 0.02, 3: 0.03})
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
    stats = llm.get_spec_decode_stats()
    assert stats.num_draft_tokens == 0 and stats.num_steps > 100   # past step 16, where a probe would draft
    shadows = llm.engine.drafting.shadows
    assert sum(sum(shadows.engine(size).proposed) for size in range(1, 5)) > 0


def test_sampled_requests_learn_and_keep_their_distribution_path(tiny_llama_dir):
    """Sampled requests are trimmed like greedy ones, and a seeded one keeps its tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    fixed = LLM(model=tiny_llama_dir, **KW, speculative_config=spec)
    want = fixed.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    dynamic = LLM(model=tiny_llama_dir, **KW, speculative_config={**spec, "dynamic_k": True})
    pin_forward_costs(dynamic, {1: 0.01, 2: 0.02, 3: 0.03})
    assert dynamic.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids == want
    assert dynamic.get_spec_decode_stats().num_draft_tokens == 0         # costly rows: none verified
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    dynamic.generate(PROMPTS, unseeded, use_tqdm=False)
    assert dynamic.get_spec_decode_stats().num_draft_tokens == 0
