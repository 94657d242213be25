"""End-to-end generation on the real default model (SmolLM2-135M-Instruct), no speculation.

Every exact-equality test runs in float32: in bfloat16 the rounding of a matmul
depends on the batch's shape, so a near-tie between the top two logits can flip
between "alone" and "in a batch of 8" (or between specserve and transformers)
without any bug. In float32 those differences are ~1e-5 and never flip a token
in these short (16-24 token) generations.

Cost: the default model's weights are loaded once for the module (see
``shared_weights``) and engines are module-scoped; generations are 16 tokens (24 against transformers).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from specserve import LLM, SamplingParams

from model_cache import cached_model_loads

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 16
HF_MAX_TOKENS = 24  # the comparison with transformers runs a little longer
BYTES_PER_BLOCK_FP32 = 2 * 16 * 3 * 64 * 4 * 30   # K+V, block 16, 3 KV heads, head_dim 64, fp32, 30 layers


@pytest.fixture(scope="module", autouse=True)
def shared_weights():
    """Load each model once per module instead of once per engine.

    Dequantizing the default GGUF takes ~7 s; the engines below all want the same
    float32 weights. The loader itself is tested in tests/model_executor; here each
    engine gets the first load's (read-only) tensors in a fresh dict.
    """
    with cached_model_loads() as cached:
        yield cached


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory=160 * BYTES_PER_BLOCK_FP32)


CHATS = [  # the first ends with EOS within 24 tokens; the second has a system prompt
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why do cats purr?"}],
]

LONG_TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
    "experimented with two-wheeled machines pushed along by the rider's feet. Over the following "
    "decades pedals, chains, pneumatic tyres and lighter frames turned the curiosity into one of the "
    "most efficient means of transport ever devised. Summarize this paragraph in one sentence:"
)


def mixed_prompts(tok) -> list[list[int]]:
    """8 prompts from 3 to ~100 tokens, chat-formatted and raw."""
    def chat(content):
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    raw = [
        "Hello, my",
        "The capital of Italy is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea, there lived",
    ]
    prompts = [tok.encode(p, add_special_tokens=False) for p in raw]
    prompts += [chat("Name three colors."), chat("Explain gravity to a child."),
                chat("List the first five prime numbers."), chat(LONG_TEXT)]
    return prompts


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def prompts(llm):
    ps = mixed_prompts(llm.get_tokenizer())
    lens = sorted(len(p) for p in ps)
    assert lens[0] <= 5 and lens[-1] >= 90, lens
    return ps


@pytest.fixture(scope="module")
def batch_ref(llm, prompts):
    """Greedy outputs of the 8 prompts generated together: the reference for later tests."""
    outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0] for o in outs]


# ------------------------------------------------------------------ vs transformers
def test_greedy_matches_transformers(llm, shared_weights):
    from transformers import AutoModelForCausalLM

    loaded = shared_weights(None, torch.float32)
    tok = loaded.tokenizer
    hf = AutoModelForCausalLM.from_config(loaded.config)
    hf.load_state_dict(loaded.state_dict, strict=False)
    hf.tie_weights()
    hf = hf.float().eval()

    outs = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=HF_MAX_TOKENS))
    for msgs, out in zip(CHATS, outs):
        # transformers tokenizes the chat template without adding special tokens, as LLM.chat does.
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=HF_MAX_TOKENS, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        expected = gen[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in expected:  # both include the EOS token and stop there
            expected = expected[: expected.index(tok.eos_token_id) + 1]
        got = out.outputs[0]
        assert got.token_ids == expected, (tok.decode(got.token_ids), tok.decode(expected))
        assert got.finish_reason == ("stop" if expected[-1] == tok.eos_token_id else "length")
        assert got.text == tok.decode(expected, skip_special_tokens=True)


# ------------------------------------------------------------------ batch invariance
def test_greedy_batch_invariance(llm, prompts, batch_ref):
    for p, ref in zip(prompts, batch_ref):
        alone = llm.generate(p, GREEDY)[0].outputs[0]
        assert alone.token_ids == ref.token_ids
        assert alone.text == ref.text
    assert len({tuple(r.token_ids) for r in batch_ref}) == len(prompts)  # not one degenerate output
    assert not llm.engine.has_unfinished_requests()


def test_seeded_sampling_reproducible_alone_and_batched(llm, prompts):
    chosen = prompts[:2] + prompts[4:6]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, max_tokens=16) for i in range(len(chosen))]
    batched = [o.outputs[0].token_ids for o in llm.generate(chosen, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(chosen[::-1], params[::-1])][::-1]
    assert batched == again
    assert llm.generate(chosen[0], params[0])[0].outputs[0].token_ids == batched[0]
    # The seed matters: another seed gives another continuation (an open-ended chat prompt).
    other = dataclasses.replace(params[3], seed=params[3].seed + 1)
    assert llm.generate(chosen[3], other)[0].outputs[0].token_ids != batched[3]


# ------------------------------------------------------------------ stopping
def test_stop_string(llm, prompts, batch_ref):
    i = next(i for i, r in enumerate(batch_ref) if r.finish_reason == "length" and len(r.text) > 30)
    full = batch_ref[i].text
    stop = full[15:21]
    assert stop.strip(), full
    cut = full.index(stop)
    out = llm.generate(prompts[i], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop, "@@never@@"]))[0]
    got = out.outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == full[:cut]
    assert stop not in got.text
    assert got.token_ids == batch_ref[i].token_ids[: len(got.token_ids)]


def test_stop_token_ids_and_max_tokens(llm, prompts, batch_ref):
    ref = batch_ref[3].token_ids
    assert len(ref) == MAX_TOKENS
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    outs = llm.generate(
        [prompts[3], prompts[3]],
        [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_tok]),
         SamplingParams(temperature=0.0, max_tokens=7)],
    )
    stopped, short = outs[0].outputs[0], outs[1].outputs[0]
    assert stopped.token_ids == ref[: first + 1]   # the stop token is kept, nothing after it
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_tok
    assert short.token_ids == ref[:7] and short.finish_reason == "length"


def test_logprobs(llm, prompts, batch_ref):
    outs = llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5),
                                      SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)])
    five, zero = outs[0].outputs[0], outs[1].outputs[0]
    assert five.token_ids == batch_ref[0].token_ids and zero.token_ids == batch_ref[1].token_ids
    assert len(five.logprobs) == len(five.token_ids) and len(zero.logprobs) == len(zero.token_ids)
    for tok, entry in zip(five.token_ids, five.logprobs):
        assert tok in entry and 5 <= len(entry) <= 6
        for lp in entry.values():
            assert math.isfinite(lp.logprob) and lp.logprob <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert entry[tok].rank == 1
        assert entry[tok].logprob == pytest.approx(max(lp.logprob for lp in entry.values()))
        ranked = sorted((lp for lp in entry.values()), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == list(range(1, len(entry) + 1))[: len(ranked)]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
    for tok, entry in zip(zero.token_ids, zero.logprobs):
        assert list(entry) == [tok] and math.isfinite(entry[tok].logprob) and entry[tok].logprob <= 0.0
    assert batch_ref[0].logprobs is None  # not asked for, not computed


# ------------------------------------------------------------------ errors
def test_invalid_sampling_params():
    for bad in [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0), dict(top_k=-2),
                dict(min_p=1.5), dict(n=0), dict(presence_penalty=3.0), dict(logprobs=1000), dict(stop=[""])]:
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        LLM(model=str(tmp_path / "no-such-model"), dtype="float32")


@pytest.fixture(scope="module")
def small_llm():
    return LLM(dtype="float32", max_model_len=64, kv_cache_memory=16 * BYTES_PER_BLOCK_FP32)


def test_prompt_too_long_raises_before_any_work(small_llm):
    tok = small_llm.get_tokenizer()
    ok = tok.encode("The capital of France is", add_special_tokens=False)
    too_long = tok.encode(LONG_TEXT, add_special_tokens=False)
    assert len(too_long) > 64
    with pytest.raises(ValueError, match="max_model_len"):
        small_llm.generate(too_long, GREEDY)
    # One bad prompt in a batch: nothing runs, nothing is left behind.
    with pytest.raises(ValueError, match="prompt 1"):
        small_llm.generate([ok, too_long, ok], GREEDY)
    assert not small_llm.engine.has_unfinished_requests()
    assert not small_llm.engine.requests
    with pytest.raises(ValueError, match="empty"):
        small_llm.generate([ok, []], GREEDY)
    assert not small_llm.engine.has_unfinished_requests()
    # The engine still works afterwards.
    out = small_llm.generate(ok, SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_generation_stops_at_max_model_len(small_llm):
    tok = small_llm.get_tokenizer()
    prompt = tok.encode(LONG_TEXT, add_special_tokens=False)[:60]
    out = small_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == 64
    assert out.finish_reason == "length"


# ------------------------------------------------------------------ scheduling
def test_chunked_prefill_equals_unchunked(prompts, batch_ref):
    chunked = LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 * BYTES_PER_BLOCK_FP32,
                  max_num_batched_tokens=32)
    step_tokens = []
    execute = chunked.engine.runner.execute

    def recording_execute(inputs):
        step_tokens.append(sum(len(i.token_ids) for i in inputs))
        return execute(inputs)

    chunked.engine.runner.execute = recording_execute
    long_i = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert len(prompts[long_i]) >= 90
    picked = [long_i, 0, 5]   # the long prompt chunks while the short ones already decode
    outs = chunked.generate([prompts[i] for i in picked], GREEDY)
    for i, out in zip(picked, outs):
        assert out.outputs[0].token_ids == batch_ref[i].token_ids
    assert max(step_tokens) <= 32
    assert len(step_tokens) >= MAX_TOKENS + len(prompts[long_i]) // 32


def test_preemption_gives_same_output(prompts, batch_ref):
    # 8 blocks of 16 tokens: exactly one request of max_model_len=128 fits; the 8
    # prompts (3-100 tokens, +16 new) do not, so the scheduler must preempt and recompute.
    tight = LLM(dtype="float32", max_model_len=128, kv_cache_memory=8 * BYTES_PER_BLOCK_FP32)
    assert tight.engine.kv_cache.num_blocks == 8
    outs = tight.generate(prompts, GREEDY)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for out, ref in zip(outs, batch_ref):
        assert out.outputs[0].token_ids == ref.token_ids
        assert out.outputs[0].text == ref.text
    assert not tight.engine.has_unfinished_requests()
    assert tight.engine.kv_cache.num_free_blocks == 8


def test_prefix_caching_gives_the_same_greedy_tokens(llm, prompts, batch_ref):
    """Each prompt resent with its answer appended (a conversation's next turn): the
    caching engine finds the prompt and answer blocks it computed for ``batch_ref``,
    an engine without caching computes everything; same greedy tokens."""
    resent = [list(p) + list(r.token_ids) for p, r in zip(prompts, batch_ref)]
    hits = llm.get_prefix_cache_stats()["hits"]
    cached = llm.generate(resent, GREEDY)
    assert llm.get_prefix_cache_stats()["hits"] > hits
    plain = LLM(dtype="float32", max_model_len=512, kv_cache_memory=160 * BYTES_PER_BLOCK_FP32,
                enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain.generate(resent, GREEDY)]
