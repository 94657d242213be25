"""The real target/draft pair of the catalog: Qwen2.5-Coder-1.5B-Instruct drafted by
Qwen2.5-Coder-0.5B-Instruct, in the default dtype (the GGUF files' own blocks).

Skipped with the reason when the pair's PyPI packages are absent (docs/real_models.md says
how to install them); the default install and CI do not need them.
"""
from __future__ import annotations

import gc

import pytest

from specserve import LLM, SamplingParams
from specserve.entrypoints.fill_in_middle import fim_params, fim_prompt
from catalog_files import installed_file
from test_spec_decode import _chi_square_p

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (installed_file(TARGET) and installed_file(DRAFT)),
                       reason=f"the {TARGET} / {DRAFT} packages are not installed (see docs/real_models.md)"),
]

KW = dict(model=TARGET, max_model_len=1024, kv_cache_memory=1 << 28)
CODE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Fix the bug:\n```python\ndef last(xs):\n    return xs[len(xs)]\n```",
    "Explain what this does:\n```python\nprint(sorted(set(open('f').read().split())))\n```",
    "Write a function `is_palindrome(s)` in Python.",
]


@pytest.fixture(scope="module")
def plain():
    llm = LLM(**KW)
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def chats(plain):
    tok = plain.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in CODE_PROMPTS]


@pytest.fixture(scope="module")
def want(plain, chats):
    return [o.outputs[0].token_ids for o in plain.generate(chats, SamplingParams(temperature=0, max_tokens=24))]


@pytest.fixture(scope="module")
def spec():
    llm = LLM(**KW, speculative_config={"model": DRAFT, "num_speculative_tokens": 4})
    yield llm
    del llm
    gc.collect()


def test_pair_greedy_equals_plain_at_batch_1_and_4(spec, chats, want):
    params = SamplingParams(temperature=0, max_tokens=24)
    assert [o.outputs[0].token_ids for o in spec.generate(chats, params)] == want              # batch 4
    assert [spec.generate([c], params)[0].outputs[0].token_ids for c in chats[:2]] == want[:2]   # batch 1
    stats = spec.get_spec_decode_stats()
    assert stats.num_accepted_tokens > 0 and stats.mean_acceptance_length > 1.5


def test_pair_fills_in_the_middle_as_plain_does(plain, spec):
    """Qwen2.5-Coder's fill-in-the-middle (the server's ``suffix``): the middle of a function,
    ended by an end-of-middle token, the same with the draft speculating."""
    tok = plain.get_tokenizer()
    prompt = fim_prompt(tok, "def fibonacci(n):\n    ", "\n\nprint(fibonacci(10))\n")
    params = fim_params(tok, SamplingParams(temperature=0, max_tokens=64))
    [got], [ref] = spec.generate([prompt], params), plain.generate([prompt], params)
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert ref.outputs[0].finish_reason == "stop" and "return" in ref.outputs[0].text


def _second_tokens_of_samples(llm: LLM, prompt: list[int], n: int, max_tokens: int,
                              seed: int | None) -> tuple[list[int], list[int]]:
    """n samples (seeds seed, seed + 1, ...; None: unseeded) as requests of up to 50 samples each
    -> (first tokens, second tokens). A request's samples find the prompt's full blocks in the
    prefix cache, so each computes only the prompt's last partial block itself."""
    sizes = [min(50, n - start) for start in range(0, n, 50)]
    params = [SamplingParams(n=size, temperature=1.0, seed=None if seed is None else seed + 50 * i,
                             max_tokens=max_tokens, ignore_eos=True) for i, size in enumerate(sizes)]
    samples = [c for out in llm.generate([prompt] * len(sizes), params, use_tqdm=False) for c in out.outputs]
    return [c.token_ids[0] for c in samples], [c.token_ids[1] for c in samples]


def test_pair_second_token_distribution_matches_plain(plain):
    """The first speculated token (the second generated) at temperature 1.0: with the plain run's
    seeds (32 samples) it is the target's own choice, so plain decoding's token, sample for
    sample; unseeded (150 samples) it goes through rejection sampling and has the target's
    distribution (chi-square two-sample test against 150 plain samples). The samples are those of
    n > 1 requests on an 18-token prompt: each computes the last two prompt tokens itself (with
    one left, its first token would come through verification too)."""
    text = 'def sort_list(xs):\n    """Return the list xs sorted, smallest first, without changing xs.'
    prompt = plain.get_tokenizer().encode(text, add_special_tokens=False)[:18]
    assert len(prompt) == 18
    spec = LLM(**KW, speculative_config={"model": DRAFT, "num_speculative_tokens": 1})
    first_spec, second_spec = _second_tokens_of_samples(spec, prompt, 32, max_tokens=3, seed=0)
    _, second_unseeded = _second_tokens_of_samples(spec, prompt, 150, max_tokens=3, seed=None)
    assert spec.get_spec_decode_stats().num_draft_tokens == 32 + 150
    del spec
    gc.collect()
    first_plain, second_plain = _second_tokens_of_samples(plain, prompt, 150, max_tokens=2, seed=0)
    assert first_spec == first_plain[:32] and second_spec == second_plain[:32]   # same seeds: plain's tokens
    assert _chi_square_p(second_plain, second_unseeded) > 1e-3


def test_requantized_draft_keeps_the_pair_lossless(chats, want):
    """The 0.5B draft (Q5_0, Q8_0, Q4_K, Q6_K) requantized to Q4_1 at load, with its head cut to the
    32,768 likeliest tokens (``draft_vocab_size``)."""
    spec = LLM(**KW, speculative_config={"model": DRAFT, "num_speculative_tokens": 3, "draft_vocab_size": 32768,
                                         "draft_quantization": "q4_1"})
    assert spec.engine.proposer.runner.model.lm_head.quantized.qtypes == [3]
    got = [o.outputs[0].token_ids for o in spec.generate(chats, SamplingParams(temperature=0, max_tokens=24))]
    assert got == want
    assert spec.get_spec_decode_stats().num_accepted_tokens > 0


def test_pair_draft_at_tp1_with_target_at_tp2_equals_tp1(chats, want):
    """The target on 2 gloo ranks, the 0.5B draft in the driver at TP 1: greedy answers are the
    TP 1 plain answers."""
    spec = LLM(**KW, tensor_parallel_size=2,
               speculative_config={"model": DRAFT, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1,
                                   "draft_vocab_size": 32768})
    assert len(spec.engine.runner.worker_pids) == 1
    got = [o.outputs[0].token_ids for o in spec.generate(chats, SamplingParams(temperature=0, max_tokens=24))]
    assert got == want
    assert spec.get_spec_decode_stats().num_accepted_tokens > 0
    del spec
    gc.collect()
