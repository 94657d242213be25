"""``SamplingParams.allowed_token_ids`` (vLLM's): every token of the output is one of them,
greedy or sampled, and under speculation the tokens are plain decoding's (the verifier and the
draft proposers mask the same rows); ids outside the vocabulary are refused before any work.
Tiny random model."""
from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.sampling_params import StructuredOutput

from proposer_specs import PROPOSERS, proposer_config, tiny_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [(53 * i + 9) % 3000 + 200 for i in range(20)]
ALLOWED = [300, 301, 302, 303, 304, 2000, 4000]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return tiny_engine(tiny_llama_dir)


def tokens(llm, **kw) -> list[int]:
    [out] = llm.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True, **kw), use_tqdm=False)
    return out.outputs[0].token_ids


def test_every_token_is_an_allowed_one(plain):
    assert not set(tokens(plain, temperature=0)) <= set(ALLOWED)
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=1.5, seed=4, top_k=3)):
        got = tokens(plain, allowed_token_ids=ALLOWED, **kw)
        assert len(got) == 16 and set(got) <= set(ALLOWED), kw
    assert len(set(tokens(plain, temperature=1.0, seed=5, allowed_token_ids=ALLOWED))) > 1


@pytest.mark.parametrize("spec", PROPOSERS)
def test_speculation_gives_plain_tokens(tiny_llama_dir, tiny_draft_dir, tiny_eagle_dir, plain, spec):
    llm = tiny_engine(tiny_llama_dir, proposer_config(spec, tiny_draft_dir, tiny_eagle_dir))
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=8)):
        assert tokens(llm, allowed_token_ids=ALLOWED, **kw) == tokens(plain, allowed_token_ids=ALLOWED, **kw)


def test_bad_ids_are_refused(plain):
    with pytest.raises(ValueError, match="allowed_token_ids token ids out of range"):
        plain.generate(PROMPT, SamplingParams(allowed_token_ids=[5, 10 ** 6]), use_tqdm=False)
    for bad in ([], [-1], "12", [1.5]):
        with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="structured output"):
        SamplingParams(allowed_token_ids=[1], structured_output=StructuredOutput(regex="a"))
