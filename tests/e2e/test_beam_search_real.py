"""Beam search on the default model (SmolLM2-135M-Instruct, GGUF Q4_1) against transformers'
``num_beams`` search on the same file (``gguf_file=``, dequantized, float32).

Semantics set alike on both sides (specserve's are transformers', beam_search_params.py):
B = 4 beams, 4 returned, greedy (no sampling), EOS ends a beam, ``length_penalty`` 1.0 (the
default: score = cumulative log-probability / generated length, EOS counted) and 0.0 (the
cumulative log-probability), ``early_stopping`` False (the default heuristic) and True.

specserve runs in float32 here (transformers' numbers up to kernel rounding): the same beams,
in the same order, and cumulative log-probabilities within 2e-3 (32 tokens of float32
log-softmax sums from different matmul kernels; the measured gap is ~1e-4). Then the default
dtype with n-gram speculation, the shipped draft model and the shipped EAGLE head gives plain
beam search's beams and scores bit for bit (n-gram commits several depths in some passes on the
answer that copies its prompt; the draft model's and EAGLE's chains, one per beam, hardly ever
hold for all four beams at once: docs/speculative_decoding.md, "Beam search").
"""
from __future__ import annotations

import pytest
import torch

from specserve import LLM
from specserve.beam_search_params import BeamSearchParams

from catalog_files import installed_file
from transformers_gguf import causal_lm_from_gguf

NAME = "smollm2-135m-instruct"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(installed_file(NAME) is None, reason=f"the {NAME} package is not installed")]

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "Give me three tips for sleeping better.",
             "Add type hints to this function and show the whole function:\n\ndef area(width, height):\n"
             "    if width < 0 or height < 0:\n        raise ValueError('negative size')\n    return width * height\n"]
SETTINGS = [(1.0, False), (0.0, True)]     # (length_penalty, early_stopping)
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def plain32():
    return LLM(model=None, dtype="float32", max_model_len=1024, kv_cache_memory=1 << 27)


@pytest.fixture(scope="module")
def prompts(plain32) -> list[list[int]]:
    return [plain32.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_the_beams_and_cumulative_logprobs_of_transformers(plain32, prompts):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read a GGUF file")
    from transformers import GenerationConfig

    eos = plain32.get_tokenizer().eos_token_id
    ours = {s: plain32.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=s[0],
                                                             early_stopping=s[1])) for s in SETTINGS}
    hf = causal_lm_from_gguf(installed_file(NAME))
    worst = 0.0
    for (length_penalty, early_stopping), outputs in ours.items():
        config = GenerationConfig(num_beams=4, num_return_sequences=4, max_new_tokens=MAX_TOKENS, do_sample=False,
                                  length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                                  pad_token_id=eos, output_scores=True, return_dict_in_generate=True)
        for ids, out in zip(prompts, outputs):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  generation_config=config)
            for seq, score, mine in zip(ref.sequences, ref.sequences_scores.tolist(), out.sequences):
                generated = seq[len(ids):].tolist()
                if eos in generated:
                    generated = generated[: generated.index(eos) + 1]
                assert mine.tokens[len(ids):] == generated
                cum = score * len(generated) ** length_penalty
                assert mine.cum_logprob == pytest.approx(cum, abs=2e-3)
                worst = max(worst, abs(mine.cum_logprob - cum))
    print(f"largest |cumulative log-probability difference|: {worst:.2e}")


@pytest.fixture(scope="module")
def plain_beams(prompts):
    """Plain beam search in the default dtype."""
    plain = LLM(model=None, max_model_len=1024, kv_cache_memory=1 << 27)
    return plain.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS))


@pytest.mark.parametrize("spec", ["ngram", "draft_model", "eagle"])
def test_speculation_gives_plain_beams_bit_for_bit_in_the_default_dtype(prompts, plain_beams, spec):
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS)
    expected = plain_beams
    config = {"method": spec, "num_speculative_tokens": 4}   # draft_model, eagle: the drafts the default model ships with
    fast = LLM(model=None, max_model_len=1024, kv_cache_memory=1 << 27, speculative_config=config)
    got = fast.beam_search(prompts, params)
    for a, b in zip(expected, got):
        assert [(s.tokens, s.cum_logprob, s.score, [list(d.values())[0].logprob for d in s.logprobs])
                for s in a.sequences] == [(s.tokens, s.cum_logprob, s.score,
                                           [list(d.values())[0].logprob for d in s.logprobs]) for s in b.sequences]
    if spec == "ngram":    # the type-hint answer copies the function: every beam's drafts hold for a while
        assert fast.get_spec_decode_stats().mean_acceptance_length > 1.0
