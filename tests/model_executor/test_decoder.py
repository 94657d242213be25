"""specserve's decoder against transformers' reference implementation, for every family.

Same weights, same tokens: our logits (paged KV cache, flat batches, chunked
prefill) must equal transformers' ``*ForCausalLM`` logits. Everything runs in
float32, where the only differences are summation order (different matmul and
attention kernels), so the tolerances are tight:

- tiny random models (logits of magnitude ~1-10): max abs diff < 1e-4;
- the real default model (logits of magnitude ~40): max abs diff < 1e-3.

Measured on the 2-core CPU with one torch thread: at most 7e-6 over the tiny families
(prompts of 40-60 tokens, past every sliding window of 16 and every rope scaling's
original context of 32); ~4e-5 on the real model with other thread counts; a 1e-3
change to one q/k/v bias of the tiny Qwen2 moves the logits by 2e-4, so the tiny-model
tolerance does catch a wrong weight.

Paths that compute the same thing with different shapes (one pass vs two
chunks, one request vs a flat batch of two) are held to the same 1e-4 / 1e-3.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

try:  # transformers 5
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4
    from transformers.modeling_utils import no_init_weights

from specserve.model_executor.layers import cpu_attention, quant_gemm
from specserve.model_executor.loader import load_model
from specserve.worker.model_runner import ForwardInput, ModelRunner

from model_families import FAMILIES, VOCAB, WINDOW, WINDOWED, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 16
TINY_ATOL = 1e-4
REAL_ATOL = 1e-3


# --------------------------------------------------------------------------- helpers
def make_runner(config, state_dict, num_blocks: int = 32, max_model_len: int = 256) -> ModelRunner:
    runner = ModelRunner(config, state_dict, torch.float32, torch.device("cpu"), max_model_len, BLOCK_SIZE)
    runner.allocate_kv_cache(num_blocks)
    return runner


def run_chunks(runner: ModelRunner, tokens: list[int], chunk_lens: list[int], block_table: list[int]) -> torch.Tensor:
    """Prefill ``tokens`` in chunks through the paged cache; logits at every position [T, V]."""
    assert sum(chunk_lens) == len(tokens)
    out, start = [], 0
    for n in chunk_lens:
        chunk = tokens[start : start + n]
        out.append(runner.execute([ForwardInput(chunk, start, block_table, num_logits=n)]).logits)
        start += n
    return torch.cat(out)


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0].float()


def save_tiny(model, folder, tokenizer) -> str:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # the loader wants a tokenizer; any one will do for logits
    return str(folder)


@pytest.fixture(scope="module")
def default_tokenizer(default_model_tokenizer):
    return default_model_tokenizer


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny_pair(request, tmp_path_factory, default_tokenizer):
    """(transformers model, specserve runner) over the same weights, loaded from a saved folder:
    one of every family and rope variant specserve supports (tests/model_families.py)."""
    hf = tiny_model(request.param)
    folder = save_tiny(hf, tmp_path_factory.mktemp(f"tiny-{request.param}"), default_tokenizer)
    loaded = load_model(folder, torch.float32)
    assert loaded.config.model_type == hf.config.model_type
    return hf, make_runner(loaded.config, loaded.state_dict)


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------ tiny random models
def test_tiny_matches_transformers(tiny_pair):
    hf, runner = tiny_pair
    tokens = prompt(hf.config.vocab_size, 40, seed=3)
    ref = hf_logits(hf, tokens)
    # A non-contiguous, unordered block table: the paging must not assume block i at slot i.
    ours = run_chunks(runner, tokens, [40], block_table=[7, 2, 19])
    assert ours.shape == ref.shape
    assert ref.abs().max() > 1.0, "random weights too small to make this test meaningful"
    assert (ours - ref).abs().max() < TINY_ATOL


def test_tiny_chunked_prefill_and_decode_equal_one_pass(tiny_pair):
    hf, runner = tiny_pair
    tokens = prompt(hf.config.vocab_size, 45, seed=4)
    one_pass = run_chunks(runner, tokens, [45], block_table=[3, 9, 1])
    # Chunks that do not line up with block boundaries, then single-token decode steps.
    chunked = run_chunks(runner, tokens, [13, 21, 1, 1, 1, 8], block_table=[5, 0, 11])
    assert (chunked - one_pass).abs().max() < TINY_ATOL
    assert (chunked - hf_logits(hf, tokens)).abs().max() < TINY_ATOL


def test_tiny_flat_batch_equals_each_alone(tiny_pair):
    hf, runner = tiny_pair
    vocab = hf.config.vocab_size
    a, b = prompt(vocab, 23, seed=5), prompt(vocab, 37, seed=6)
    alone_a = run_chunks(runner, a, [23], block_table=[0, 1])
    alone_b = run_chunks(runner, b, [37], block_table=[2, 3, 4])
    # Request b's first 30 tokens are already in the cache (a previous chunk); then one
    # step carries a's whole prompt and b's last 7 tokens: different query lengths
    # (the padded attention path) and b at start_position > 0.
    runner.execute([ForwardInput(b[:30], 0, [12, 13, 14], num_logits=0)])
    batch = runner.execute([
        ForwardInput(a, 0, [10, 11], num_logits=23),
        ForwardInput(b[30:], 30, [12, 13, 14], num_logits=7),
    ]).logits
    assert batch.shape == (30, vocab)
    assert (batch[:23] - alone_a).abs().max() < TINY_ATOL
    assert (batch[23:] - alone_b[30:]).abs().max() < TINY_ATOL
    # num_logits picks the last positions only.
    last = runner.execute([ForwardInput(a, 0, [10, 11], num_logits=1), ForwardInput(b, 0, [2, 3, 4], num_logits=2)])
    assert (last.logits[0] - alone_a[-1]).abs().max() < TINY_ATOL
    assert (last.logits[1:] - alone_b[-2:]).abs().max() < TINY_ATOL


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_window_ignored_would_fail(family, tmp_path, default_tokenizer):
    """The window is what makes these families match: the same weights with the window
    dropped from the config (specserve's behaviour before it read windows) answer differently
    past the window, by far more than the tolerance."""
    hf = tiny_model(family)
    loaded = load_model(save_tiny(hf, tmp_path, default_tokenizer), torch.float32)
    tokens = prompt(hf.config.vocab_size, 3 * WINDOW, seed=8)
    ref = hf_logits(hf, tokens)
    assert (run_chunks(make_runner(loaded.config, loaded.state_dict), tokens, [len(tokens)], [0, 1, 2]) - ref
            ).abs().max() < TINY_ATOL
    loaded.config.sliding_window = None
    windowless = run_chunks(make_runner(loaded.config, loaded.state_dict), tokens, [len(tokens)], [0, 1, 2])
    assert (windowless[:WINDOW] - ref[:WINDOW]).abs().max() < TINY_ATOL   # inside the window: the same
    assert (windowless - ref).abs().max() > 100 * TINY_ATOL


def families_fast_and_slow(fast=("gemma3", "qwen3", "phi3", "olmo2", "mistral")):
    """Every family; those outside ``fast`` (the most different ones) in the slow tier only,
    to keep the fast tier near 2 minutes."""
    return [f if f in fast else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


@pytest.mark.parametrize("family", families_fast_and_slow())
def test_tiny_greedy_tokens_equal_transformers(family, tmp_path, default_tokenizer):
    """32 greedy tokens through the engine (prefill, then decode steps crossing the sliding
    windows) equal transformers' ``generate`` from the same 40-token prompt, in float32."""
    from specserve import LLM, SamplingParams

    hf = tiny_model(family)
    folder = save_tiny(hf, tmp_path, default_tokenizer)
    tokens = prompt(hf.config.vocab_size, 40, seed=9)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([tokens]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    llm = LLM(model=folder, dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref


@pytest.mark.parametrize("family", families_fast_and_slow(fast=("gemma3", "qwen3")))
def test_tiny_greedy_speculation_equals_plain_in_default_dtype(family, tmp_path, default_tokenizer):
    """Lossless greedy speculation on every family in the CPU default dtype: n-gram drafts, a draft
    model of the same family (other weights, same vocabulary) and an EAGLE head over the target's
    hidden states (started from its last layer, its fc perturbed) give plain decoding's tokens."""
    from specserve import LLM, SamplingParams
    from specserve.training.train_eagle import EagleTask

    target = save_tiny(tiny_model(family), tmp_path / "target", default_tokenizer)
    draft = save_tiny(tiny_model(family, seed=7), tmp_path / "draft", default_tokenizer)
    loaded = load_model(target, torch.float32)
    task = EagleTask(loaded.config, loaded.state_dict, None, family)
    with torch.no_grad():
        task.module.fc.weight.add_(0.3 * torch.randn(task.module.fc.weight.shape, generator=torch.Generator().manual_seed(5)))
    eagle = str(tmp_path / "eagle")
    task.export(eagle, {})
    vocab = VOCAB
    motif = prompt(vocab, 12, seed=10)
    prompts = [motif * 4, prompt(vocab, 30, seed=11) + motif * 2]   # repeats give n-gram drafts
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(model=target, max_model_len=160, kv_cache_memory=1 << 22)
    plain = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, params)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
                 {"method": "eagle", "model": eagle, "num_speculative_tokens": 3}):
        llm = LLM(**common, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain, spec["method"]
        assert llm.get_spec_decode_stats().num_draft_tokens > 0


# ------------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def default_pair():
    loaded = load_model(None, torch.float32)
    with no_init_weights():  # every weight is loaded next: skip the random init (~3 s for 135M)
        hf = AutoModelForCausalLM.from_config(loaded.config)
    missing, unexpected = hf.load_state_dict(loaded.state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    hf.tie_weights()
    hf = hf.float().eval()
    runner = make_runner(loaded.config, loaded.state_dict, num_blocks=16, max_model_len=256)
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
        tokenize=False, add_generation_prompt=True,
    )
    return hf, runner, tok.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_default_model_matches_transformers(default_pair):
    hf, runner, tokens = default_pair
    assert len(tokens) > BLOCK_SIZE  # spans blocks
    ref = hf_logits(hf, tokens)
    ours = run_chunks(runner, tokens, [len(tokens)], block_table=[4, 1, 9])
    assert ref.abs().max() > 10  # real logits, not a degenerate model
    assert (ours - ref).abs().max() < REAL_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_default_model_chunked_and_batched(default_pair):
    hf, runner, tokens = default_pair
    n = len(tokens)
    one_pass = run_chunks(runner, tokens, [n], block_table=[0, 1, 2])
    two_chunks = run_chunks(runner, tokens, [n - 11, 11], block_table=[3, 4, 5])
    assert (two_chunks - one_pass).abs().max() < REAL_ATOL
    other = tokens[:-7]
    alone_other = run_chunks(runner, other, [len(other)], block_table=[6, 7, 8])
    batch = runner.execute([
        ForwardInput(tokens, 0, [9, 10, 11], num_logits=n),
        ForwardInput(other, 0, [12, 13, 14], num_logits=len(other)),
    ]).logits
    assert (batch[:n] - one_pass).abs().max() < REAL_ATOL
    assert (batch[n:] - alone_other).abs().max() < REAL_ATOL


def default_dtype_runner(keep_quantized: bool, num_blocks: int):
    """The default model in the CPU default dtype (its GGUF blocks, or float16 weights), with
    ``num_blocks`` KV blocks, and its tokenizer; skips where the row-independent,
    chunk-invariant kernels did not build."""
    if not cpu_attention.usable("cpu", torch.float32):
        pytest.skip("the compiled attention kernel (what promises row-independent, chunk-invariant attention) "
                    "did not build")
    if keep_quantized and not quant_gemm.available():
        pytest.skip("the quantized matmul kernel did not build")
    loaded = load_model(None, torch.float16, keep_quantized=keep_quantized)
    runner = ModelRunner(loaded.config, loaded.state_dict, torch.float16, torch.device("cpu"), 256, BLOCK_SIZE)
    runner.allocate_kv_cache(num_blocks)
    return runner, loaded.tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("keep_quantized", [True, False], ids=["gguf-blocks", "float16"])
def test_default_dtype_verified_rows_have_the_bits_of_decoding_alone(keep_quantized):
    """Lossless greedy speculation rests on this, near-tie or not: in the CPU default dtype
    (the GGUF's own blocks through the quantized kernels and the per-layer compiled calls;
    and dtype="float16", float16 weights) a token verified together with drafts, in a step
    shared with another request, gets exactly the logits it gets when decoded alone, through
    the whole forward (matmuls, attention, norms, LM head)."""
    runner, tok = default_dtype_runner(keep_quantized, num_blocks=16)
    prompt_ids = tok.encode("The three primary colors are", add_special_tokens=False)
    other_ids = tok.encode("Once upon a time", add_special_tokens=False)
    n = len(prompt_ids)

    # Plain decoding: one 1-row step per token.
    logits = runner.execute([ForwardInput(prompt_ids, 0, [0, 1], num_logits=1)]).logits   # [1, V]
    generated, alone = [], []
    for i in range(6):
        generated.append(int(logits[-1].argmax()))
        logits = runner.execute([ForwardInput(generated[-1:], n + i, [0, 1], num_logits=1)]).logits
        alone.append(logits[0])
    alone = torch.stack(alone)                                                               # [6, V]

    # The same tokens verified in one step (as a draft chain would be), batched with another
    # request's prefill, on a second copy of the prompt's cache.
    runner.execute([ForwardInput(prompt_ids, 0, [2, 3], num_logits=0)])
    verified = runner.execute([
        ForwardInput(other_ids, 0, [4, 5], num_logits=1),
        ForwardInput(generated, n, [2, 3], num_logits=6),
    ]).logits[1:]                                                                            # [6, V]
    assert torch.equal(verified, alone)


@pytest.mark.slow
@pytest.mark.parametrize("keep_quantized", [True, False], ids=["gguf-blocks", "float16"])
def test_default_dtype_prompt_logits_do_not_depend_on_chunking(keep_quantized):
    """A prompt prefilled whole, in chunks cut anywhere (what the token budget, a prefix-cache
    hit or a speculative engine's lookahead slots do), or one token at a time, alongside
    another request, gets exactly the same logits at every position in the CPU default
    dtype: greedy answers cannot depend on where a prompt was cut."""
    runner, tok = default_dtype_runner(keep_quantized, num_blocks=24)
    text = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about paged attention."}],
                                   tokenize=False, add_generation_prompt=True)
    tokens = tok.encode(text, add_special_tokens=False)
    n = len(tokens)
    assert n > 2 * BLOCK_SIZE
    whole = run_chunks(runner, tokens, [n], block_table=[0, 1, 2, 3])
    cut = run_chunks(runner, tokens, [13, 21, 1, n - 35], block_table=[4, 5, 6, 7])
    assert torch.equal(cut, whole)
    # One token at a time, each step shared with another request's prefill.
    other = tok.encode("Once upon a time", add_special_tokens=False)
    single = []
    for p in range(n):
        out = runner.execute([ForwardInput(other, 0, [8, 9], num_logits=1),
                              ForwardInput(tokens[p:p + 1], p, [10, 11, 12, 13], num_logits=1)]).logits
        single.append(out[1])
    assert torch.equal(torch.stack(single), whole)
