"""A seeded request gives the same samples alone, batched, and preempted, under every
proposer.

The issue's reproduction at the engine level: four prompts, each with temperature 0.9,
seed 100 + i, n = 3 and 48 tokens, first each alone, then all four twice over at once in
a KV cache of 30 blocks, which the 24 samples overflow many times (preemption by
recompute). Before the fix each sample drew from a running generator, so its draws
depended on how many drafts each of its steps verified, which preemption (a recomputed
request samples its next token without drafts), batching and the suffix proposer's shared
state all change: most batched samples differed from their lone runs. Now every number is
keyed by the request's seed and the output index it decides (``sample.sampler``), and
verification takes the target's own choice at every position (``sample.verify``), so a
seeded sample is also the plain (unspeculated) sample with that seed.

The target is the tiny random model with its logits scaled up (``embedding_scale``): its
samples repeat often enough for n-gram and suffix lookups to hit. The draft is the same
model less scaled, so it agrees with the target often but not always. Tiny models: about
30 s for the module on a shared 2-core machine (the draft model's case is half of it).
"""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams


pytestmark = pytest.mark.usefixtures("one_torch_thread")

THINGS = ["boat", "tree", "robot", "cloud"]
PROMPTS = [f"Write a short story number {i} about a cat and a {thing}." for i, thing in enumerate(THINGS)]
SMALL_CACHE_BLOCKS = 30         # of 16 tokens; 24 samples of ~65 tokens (5 blocks each) overflow it


@pytest.fixture(scope="module")
def target_dir(peaked_llama_dir) -> str:
    return peaked_llama_dir


@pytest.fixture(scope="module")
def draft_dir(peaked_draft_dir) -> str:
    return peaked_draft_dir


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=100 + i, n=3, max_tokens=48, ignore_eos=True)


def spec_config(method: str, draft_dir: str) -> dict:
    config = {"method": method, "num_speculative_tokens": 4}
    return {**config, "model": draft_dir} if method == "draft_model" else config


def make(target_dir: str, spec: dict | None, kv_cache_memory: int = 8 << 20) -> LLM:
    return LLM(model=target_dir, dtype="float32", max_model_len=256, kv_cache_memory=kv_cache_memory,
               speculative_config=spec)


def samples(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def lone_runs(llm: LLM) -> list[list[list[int]]]:
    return [samples(llm.generate(p, params(i), use_tqdm=False)[0]) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def plain_lone_runs(target_dir) -> list[list[list[int]]]:
    return lone_runs(make(target_dir, None))


def batched_under_preemption(target_dir: str, spec: dict | None, roomy: LLM) -> tuple[list, list[str]]:
    """The four requests twice over at once in a cache of SMALL_CACHE_BLOCKS -> (their samples,
    the ids of every preempted sample, once per preemption)."""
    small = make(target_dir, spec, kv_cache_memory=SMALL_CACHE_BLOCKS * roomy.engine.runner.bytes_per_block)
    assert small.engine.kv_cache.num_blocks == SMALL_CACHE_BLOCKS
    preempted = []
    real_preempt = small.engine.scheduler._preempt

    def preempt(req, out):
        preempted.append(req.request_id)
        real_preempt(req, out)

    small.engine.scheduler._preempt = preempt
    outs = small.generate(PROMPTS * 2, [params(i) for i in range(len(PROMPTS))] * 2, use_tqdm=False)
    return [samples(o) for o in outs], preempted, small.get_spec_decode_stats()


# The draft model's case takes about 12 s (two engines with a draft each): the full suite runs it.
@pytest.mark.parametrize("method", ["ngram", "suffix", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_every_sample_equals_its_lone_run_under_preemption(target_dir, draft_dir, plain_lone_runs, method):
    spec = spec_config(method, draft_dir)
    roomy = make(target_dir, spec)
    alone = lone_runs(roomy)
    assert all(len({tuple(s) for s in run}) == 3 for run in alone)     # n = 3 different samples each
    batched, preempted, stats = batched_under_preemption(target_dir, spec, roomy)
    for j, got in enumerate(batched):
        assert got == alone[j % len(PROMPTS)], (method, j)
    assert len(preempted) >= 5                                          # the cache really overflowed
    assert stats.num_accepted_tokens > 100 and stats.num_draft_tokens > stats.num_accepted_tokens
    # Whatever was drafted, a seeded sample is the plain (unspeculated) one.
    assert alone == plain_lone_runs


@pytest.mark.default_dynamic_k
def test_dynamic_k_lengths_do_not_change_the_samples(target_dir, plain_lone_runs):
    """The issue's own configuration: n-gram with its default dynamic_k, whose draft lengths follow
    measured timings (so they differ from run to run, and under preemption); seeded requests get
    them too now, and their samples are still their lone runs, and plain decoding's."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}     # dynamic_k: the product's default
    roomy = make(target_dir, spec)
    assert roomy.engine.k_policy is not None
    assert lone_runs(roomy) == plain_lone_runs
    batched, preempted, _ = batched_under_preemption(target_dir, spec, roomy)
    assert batched == plain_lone_runs * 2
    assert len(preempted) >= 5
