"""Every feature at once: a random workload of greedy and seeded requests (n = 1 and 2, stop
strings and stop tokens, penalties and logit bias, top-k and top-p, regexes and choices), beam
searches and aborts, sharing prompt prefixes, run together under speculation in a KV cache too
small for them (preemption by recompute, prefix caching on) and with a token budget that cuts
prompts into prefill chunks. Each request that is not aborted
must give exactly what it gives alone in a plain engine with room to spare: the same tokens,
text and finish reason, and for beam searches the same beams and (to float32 rounding) scores.

Each feature has its own tests; this one looks for interactions between them (a stop string
cutting accepted drafts short while a sibling is preempted, a forked beam sharing blocks with a
cached prefix, a constrained request beside an aborted one). Tiny random models: the target's
logits scaled up so it repeats itself (n-gram lookup hits), the draft the same model scaled less.
"""
from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.beam_search_params import BeamSearchParams
from specserve.entrypoints.llm import beam_search_output
from specserve.sampling_params import StructuredOutput

from model_cache import share_folder
from tiny_models import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_REQUESTS = 22
SMALL_CACHE_BLOCKS = 24      # of 16 tokens: the workload needs several times that
MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, default_model_tokenizer) -> str:
    folder = str(tmp_path_factory.mktemp("mixed-target"))
    return share_folder(write_tiny_llama(folder, seed=0, tokenizer=default_model_tokenizer, embedding_scale=8.0))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, default_model_tokenizer) -> str:
    folder = str(tmp_path_factory.mktemp("mixed-draft"))
    return share_folder(write_tiny_llama(folder, seed=0, tokenizer=default_model_tokenizer, embedding_scale=6.0))


def workload(seed: int) -> list[tuple[str, list[int], object]]:
    """[(kind, prompt ids, params)]: kind "sample" (SamplingParams), "beam" (BeamSearchParams)
    or "abort" (SamplingParams of a request aborted mid-way)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(200, 3000) for _ in range(rng.choice([20, 33, 40]))] for _ in range(3)]
    out = []
    for i in range(NUM_REQUESTS):
        prompt = rng.choice(prefixes) + [rng.randrange(200, 3000) for _ in range(rng.randrange(1, 12))]
        roll = rng.random()
        if roll < 0.12:
            out.append(("beam", prompt, BeamSearchParams(beam_width=2, max_tokens=rng.randrange(4, 12),
                                                         length_penalty=rng.choice([0.0, 1.0]))))
            continue
        sampled = roll > 0.5
        # A few run to max_model_len (max_tokens None), where drafts and trees meet the end.
        kw = dict(max_tokens=rng.choice([None] + [rng.randrange(6, 40)] * 9), ignore_eos=rng.random() < 0.7,
                  logprobs=rng.choice([None, None, 2]))
        if sampled:
            kw.update(temperature=rng.choice([0.7, 1.0]), seed=1000 + i, n=rng.choice([1, 1, 2]))
            if rng.random() < 0.3:
                kw.update(top_k=rng.choice([5, 50]), top_p=rng.choice([0.8, 1.0]), min_p=rng.choice([0.0, 0.05]))
        else:
            kw.update(temperature=0.0)
        if rng.random() < 0.25:
            kw.update(stop=[rng.choice(["e", "an", "th", "."])])
        if rng.random() < 0.15:
            kw.update(stop_token_ids=[rng.randrange(200, 3000) for _ in range(30)])
        if rng.random() < 0.2:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={rng.randrange(200, 3000): 5.0})
        if rng.random() < 0.15:
            constraint = rng.choice([StructuredOutput(regex="[a-z ]{4,30}"),
                                     StructuredOutput(choice=["yes", "no", "maybe later"])])
            kw.update(structured_output=constraint)
        out.append(("abort" if rng.random() < 0.1 else "sample", prompt, SamplingParams(**kw)))
    return out


def make(target_dir: str, spec: dict | None, kv_cache_memory: int = 8 << 20, **kw) -> LLM:
    return LLM(model=target_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=kv_cache_memory,
               max_num_seqs=12, speculative_config=spec, **kw)


def result(kind: str, out, params):
    """What must match: tokens, text and finish reason of each completion; a search's beams."""
    if kind == "beam":   # scores to float32 rounding: a float32 row's last bits depend on its batch (MKL)
        return [(s.tokens, pytest.approx(s.cum_logprob, abs=1e-4), s.finish_reason)
                for s in beam_search_output(out, params.length_penalty).sequences]
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


@pytest.fixture(scope="module")
def alone(target_dir) -> dict[int, list]:
    """Each request of each workload alone in a plain engine with room to spare."""
    llm = make(target_dir, None)
    results = {}
    for seed in SEEDS:
        for i, (kind, prompt, params) in enumerate(workload(seed)):
            if kind == "beam":
                rid = llm.engine.add_beam_search(prompt, params)
            else:
                rid = llm.engine.add_request(prompt, params)
            final = None
            while llm.engine.has_unfinished_requests():
                for o in llm.engine.step():
                    if o.request_id == rid and o.finished:
                        final = o
            results[seed, i] = result(kind, final, params)
    return results


def run_together(llm: LLM, seed: int) -> tuple[dict[int, list], int]:
    """The workload at once, aborting its "abort" requests after their third step with output
    -> ({request index: result} for the others, preemptions)."""
    engine = llm.engine
    preempted = []
    real_preempt = engine.scheduler._preempt

    def preempt(req, out):
        preempted.append(req.request_id)
        real_preempt(req, out)

    engine.scheduler._preempt = preempt
    jobs = workload(seed)
    ids = {}
    for i, (kind, prompt, params) in enumerate(jobs):
        ids[engine.add_beam_search(prompt, params) if kind == "beam" else engine.add_request(prompt, params)] = i
    seen: dict[str, int] = {}
    results = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            i = ids[o.request_id]
            kind, _, params = jobs[i]
            seen[o.request_id] = seen.get(o.request_id, 0) + 1
            if kind == "abort" and seen[o.request_id] == 3 and not o.finished:
                engine.abort_request(o.request_id)
            elif o.finished and kind != "abort":
                results[i] = result(kind, o, params)
    engine.scheduler._preempt = real_preempt
    return results, len(preempted)


SEEDS = [0, 1]
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_tree": True},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "draft_tree": {"method": "draft_model", "num_speculative_tokens": 3, "tree": {"top_k": 2, "max_nodes": 6}},
}


@pytest.mark.parametrize("name", ["ngram", "ngram_tree"] + [pytest.param(n, marks=pytest.mark.slow)
                                                             for n in ("suffix", "draft_model", "draft_tree")])
def test_every_request_of_a_mixed_workload_is_its_lone_plain_run(target_dir, draft_dir, alone, name):
    spec = dict(SPECS[name])
    if spec["method"] == "draft_model":
        spec["model"] = draft_dir
    roomy = make(target_dir, None)
    # 48 tokens a step: long prompts are prefilled in chunks beside other requests' verifications
    small = make(target_dir, spec, kv_cache_memory=SMALL_CACHE_BLOCKS * roomy.engine.runner.bytes_per_block,
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
