"""Sampled output of draft trees with sampled children, end to end: unseeded requests are verified
by recursive rejection sampling down the tree, and their (token 1, token 2) pairs are distributed as
plain sampling's (chi-square). The power check is the walk's own test
(tests/sample/test_tree_sampler.py: a residual that only zeroes the rejected child fails it); here,
with 1,200 requests, such wrong residuals gave p-values of 0.004-0.6, too close to call."""
from __future__ import annotations

import pytest

import specserve.sample.verify as verify_module
from specserve import LLM, SamplingParams

from chi_square import pair_p_value
from tiny_models import write_tiny_llama

# slow: 1,200 requests per distribution, two engines (about 20 s)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

FAVOURED = [1000, 1001, 1002, 1003, 1004, 1005]
PROMPT = [50, 1000, 1001, 1002, 1003, 60, 1003, 1004, 1005, 70]
N = 1200
PARAMS = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logit_bias={t: 14.0 for t in FAVOURED})


@pytest.fixture(scope="module")
def peaky_target_dir(tmp_path_factory, default_model_tokenizer) -> str:
    """A target with strong preferences (logits x 3) among the favoured tokens, drafted by a nearly
    uniform one: drafts are often rejected, and the right residual (p - q) differs from p alone."""
    folder = str(tmp_path_factory.mktemp("peaky-target"))
    return write_tiny_llama(folder, seed=2, tokenizer=default_model_tokenizer, embedding_scale=3.0)


def make(model_dir, spec=None) -> LLM:
    return LLM(model=model_dir, dtype="float32", max_model_len=64, kv_cache_memory=16 << 20, max_num_seqs=128,
               speculative_config=spec)


def samples(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * N, PARAMS, use_tqdm=False)]


def test_sampled_trees_keep_plain_sampling(peaky_target_dir, tiny_draft_dir, monkeypatch):
    plain = samples(make(peaky_target_dir))
    spec = {"method": "draft_model", "model": tiny_draft_dir, "num_speculative_tokens": 2,
            "tree": {"top_k": 3, "max_nodes": 6, "children": "sampled"}}
    llm = make(peaky_target_dir, spec)
    walks = []
    real = verify_module.walk_tree_rejection
    monkeypatch.setattr(verify_module, "walk_tree_rejection", lambda *a, **k: (walks.append(1), real(*a, **k))[1])
    tree = samples(llm)
    stats = llm.get_spec_decode_stats()
    assert len(walks) >= N and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert min(pair_p_value(plain, tree, 0), pair_p_value(plain, tree, 1)) > 1e-3
