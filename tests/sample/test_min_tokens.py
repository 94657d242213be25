"""``SamplingParams.min_tokens`` (vLLM's): no end-of-sequence token, stop token or stop string
before the output holds that many tokens, and under speculation the same tokens as plain
decoding (each verified row counts the drafts before it). A tiny random model with a large
bias on the end-of-sequence token, so that without min_tokens it ends at once."""
from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.sampling_params import StructuredOutput

from proposer_specs import PROPOSERS, proposer_config, tiny_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [(41 * i + 3) % 3000 + 200 for i in range(20)]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return tiny_engine(tiny_llama_dir)


def eos_of(llm) -> int:
    return llm.get_tokenizer().eos_token_id


def run(llm, **kw):
    [out] = llm.generate(PROMPT, SamplingParams(**{"max_tokens": 20, **kw}), use_tqdm=False)
    return out.outputs[0]


def test_the_end_comes_at_min_tokens_and_not_before(plain):
    eos = eos_of(plain)
    bias = {eos: 30.0}
    assert len(run(plain, temperature=0, logit_bias=bias).token_ids) == 1          # ends at once without it
    out = run(plain, temperature=0, logit_bias=bias, min_tokens=6)
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    stop_token = 777
    out = run(plain, temperature=0, logit_bias={stop_token: 30.0}, stop_token_ids=[stop_token], min_tokens=4)
    assert out.token_ids == out.token_ids[:4] + [stop_token] and stop_token not in out.token_ids[:4]
    sampled = run(plain, temperature=1.0, seed=5, logit_bias=bias, min_tokens=9)
    assert len(sampled.token_ids) == 10 and eos not in sampled.token_ids[:9]


def test_stop_strings_wait_for_min_tokens(plain):
    first = run(plain, temperature=0, max_tokens=1)
    stop = plain.get_tokenizer().decode(first.token_ids)
    assert stop.strip(), "the first token has text to stop on"
    stopped = run(plain, temperature=0, stop=[stop])
    assert len(stopped.token_ids) == 1 and stopped.stop_reason == stop        # at its first token
    assert len(run(plain, temperature=0, stop=[stop], min_tokens=5).token_ids) >= 5


@pytest.mark.parametrize("spec", PROPOSERS)
def test_speculation_gives_plain_tokens(tiny_llama_dir, tiny_draft_dir, tiny_eagle_dir, plain, spec):
    llm = tiny_engine(tiny_llama_dir, proposer_config(spec, tiny_draft_dir, tiny_eagle_dir))
    eos = eos_of(plain)
    cases = [dict(temperature=0, logit_bias={eos: 9.0}, min_tokens=7),
             dict(temperature=1.0, seed=11, logit_bias={eos: 6.0}, min_tokens=5),
             dict(temperature=1.0, seed=12, logit_bias={eos: 6.0, 321: 6.0}, stop_token_ids=[321], min_tokens=8)]
    for kw in cases:
        want = run(plain, **kw)
        assert len(want.token_ids) > kw["min_tokens"]             # the end came right after min_tokens
        assert run(llm, **kw).token_ids == want.token_ids, kw


@pytest.mark.parametrize("kw, match", [
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(min_tokens=1.5), "min_tokens must be an integer >= 0"),
    (dict(min_tokens=9, max_tokens=8), r"min_tokens \(9\) must be at most max_tokens \(8\)"),
    (dict(min_tokens=2, structured_output=StructuredOutput(regex="[0-9]+")), "structured output"),
])
def test_bad_values_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
