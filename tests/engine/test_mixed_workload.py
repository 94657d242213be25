"""Every feature at once: a random workload of greedy and seeded requests (n = 1 and 2, stop
strings and stop tokens, penalties and logit bias, top-k and top-p, regexes, choices and a JSON schema), beam
searches and aborts, sharing prompt prefixes, run together under speculation in a KV cache too
small for them (preemption by recompute, prefix caching on) and with a token budget that cuts
prompts into prefill chunks. Each request that is not aborted
must give exactly what it gives alone in a plain engine with room to spare: the same tokens,
text and finish reason, and for beam searches the same beams and (to float32 rounding) scores.

Each feature has its own tests; this one looks for interactions between them (a stop string
cutting accepted drafts short while a sibling is preempted, a forked beam sharing blocks with a
cached prefix, a constrained request beside an aborted one). Tiny random models: the target's
logits scaled up so it repeats itself (n-gram lookup hits), the draft the same model scaled less,
an EAGLE head made from its last layer, and the target read through another vocabulary (a draft
with another tokenizer).
"""
from __future__ import annotations

import pytest

from specserve import LLM

from mixed_workload import lone_results, run_together, workload

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL_CACHE_BLOCKS = 24      # of 16 tokens: the workload needs several times that
MAX_MODEL_LEN = 160


def make(target_dir: str, spec: dict | None, kv_cache_memory: int = 8 << 20, **kw) -> LLM:
    return LLM(model=target_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=kv_cache_memory,
               max_num_seqs=12, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def alone(peaked_llama_dir) -> dict[tuple[int, int], list]:
    """Each request of each workload alone in a plain engine with room to spare."""
    llm = make(peaked_llama_dir, None)
    return {(seed, i): r for seed in SEEDS for i, r in lone_results(llm, workload(seed)).items()}


SEEDS = [0, 1]
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_tree": True},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "draft_tree": {"method": "draft_model", "num_speculative_tokens": 3, "tree": {"top_k": 2, "max_nodes": 6}},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3},
    "cross_vocab": {"method": "draft_model", "num_speculative_tokens": 3, "cross_vocab": "tli"},
}


@pytest.mark.parametrize("name", ["ngram", "ngram_tree"] + [pytest.param(n, marks=pytest.mark.slow)
                                                             for n in ("suffix", "draft_model", "draft_tree", "eagle", "cross_vocab")])
def test_every_request_of_a_mixed_workload_is_its_lone_plain_run(peaked_llama_dir, alone, name, request):
    spec = dict(SPECS[name])
    if "cross_vocab" in spec:             # the target read through another vocabulary
        spec["model"] = request.getfixturevalue("peaked_mimic_dir")
    elif spec["method"] == "draft_model":
        spec["model"] = request.getfixturevalue("peaked_draft_dir")
    elif spec["method"] == "eagle":       # prefix caching is then off (the head needs every position's features)
        spec["model"] = request.getfixturevalue("peaked_eagle_dir")
    roomy = make(peaked_llama_dir, None)
    # 48 tokens a step: long prompts are prefilled in chunks beside other requests' verifications
    small = make(peaked_llama_dir, spec, kv_cache_memory=SMALL_CACHE_BLOCKS * roomy.engine.runner.bytes_per_block,
                 max_num_batched_tokens=48)
    del roomy
    total_preempted = 0
    for seed in SEEDS:
        got, preempted = run_together(small, seed)
        total_preempted += preempted
        jobs = workload(seed)
        expected = {i: alone[seed, i] for i, (kind, _, _) in enumerate(jobs) if kind != "abort"}
        assert got.keys() == expected.keys(), (name, seed)
        for i in expected:
            assert got[i] == expected[i], (name, seed, i, jobs[i][0], jobs[i][2])
    assert total_preempted >= 3                                    # the cache really overflowed
    stats = small.get_spec_decode_stats()
    assert stats.num_accepted_tokens > 0                           # and speculation really ran
