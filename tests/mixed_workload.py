"""A random mixed workload for the engine (tests/engine/test_mixed_workload.py on the CPU,
tests/e2e/test_cuda.py under CUDA graphs): every request feature at once, and what each request
must give (its lone run)."""
from __future__ import annotations

import random

import pytest

from specserve.beam_search_params import BeamSearchParams
from specserve.entrypoints.llm import beam_search_output
from specserve.sampling_params import SamplingParams, StructuredOutput

NUM_REQUESTS = 22
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


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
                                     StructuredOutput(choice=["yes", "no", "maybe later"]),
                                     StructuredOutput(json_schema=SCHEMA)])
            kw.update(structured_output=constraint)
        out.append(("abort" if rng.random() < 0.1 else "sample", prompt, SamplingParams(**kw)))
    return out


def result(kind: str, out, params):
    """What must match: tokens, text and finish reason of each completion; a search's beams."""
    if kind == "beam":   # scores to float32 rounding: a float32 row's last bits depend on its batch (MKL)
        return [(s.tokens, pytest.approx(s.cum_logprob, abs=1e-4), s.finish_reason)
                for s in beam_search_output(out, params.length_penalty).sequences]
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def lone_results(llm, jobs) -> dict[int, list]:
    """Each job but the aborted ones alone in ``llm`` -> {job index: result}."""
    results = {}
    for i, (kind, prompt, params) in enumerate(jobs):
        if kind == "abort":
            continue
        rid = llm.engine.add_beam_search(prompt, params) if kind == "beam" else llm.engine.add_request(prompt, params)
        final = None
        while llm.engine.has_unfinished_requests():
            for o in llm.engine.step():
                if o.request_id == rid and o.finished:
                    final = o
        results[i] = result(kind, final, params)
    return results


def run_together(llm, seed: int) -> tuple[dict[int, list], int]:
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
