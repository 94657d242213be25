"""End-to-end speculative decoding on the real default model (the target), float32.

The headline invariant: greedy speculative output is token for token the plain
output, for every proposer, batch size and k, and under preemption; sampled
output has the target's distribution. Proposers:

- ``ngram``: prompt lookup (one-hot proposals);
- ``ngram_tree``: prompt lookup proposing trees of earlier continuations (several
  branches verified at once; an accepted later branch has its K/V copied down);
- ``draft_model`` with ``truncated_draft_dir`` (the default model cut to 4 layers):
  it rarely agrees with the target (~1-10% acceptance), so it mostly exercises
  rejection and recovered tokens;
- ``draft_model`` with the target itself as the draft ("self"): every draft token
  is accepted, so it exercises long accepted runs and bonus tokens.

float32 throughout, except the default-dtype tests: only the default CPU dtype
pads its matmuls to row-invariant kernels (docs/architecture.md, "Numerics"), so
float32 equality holds on these prompts but a near-tie elsewhere could flip a
greedy token; float32 keeps the logits close to transformers' for the other tests. Engines are built lazily and reused (``engines``),
with the weights loaded once per module (``shared_weights``).
"""
from __future__ import annotations

import collections
import dataclasses
import gc

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model_executor import loader
from specserve.model_executor.layers import cpu_attention, quant_gemm
from specserve.outputs import SpecDecodeStats

from model_cache import cached_model_loads

from chi_square import chi_square_p as _chi_square_p

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 16
BYTES_PER_BLOCK_FP32 = 2 * 16 * 3 * 64 * 4 * 30   # K+V, block 16, 3 KV heads, head_dim 64, fp32, 30 layers
ENGINE_KW = dict(dtype="float32", max_model_len=512, kv_cache_memory=160 * BYTES_PER_BLOCK_FP32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module", autouse=True)
def shared_weights():
    """Load each model once per module instead of once per engine (the default GGUF
    takes ~7 s to dequantize). The loader is tested in tests/model_executor; each
    engine gets the first load's read-only tensors in a fresh dict. ``cached.calls``
    counts requests, to show that invalid configurations fail before loading."""
    with cached_model_loads() as cached:
        yield cached


@pytest.fixture(scope="module")
def plain():
    return LLM(**ENGINE_KW)


class Engines:
    """Speculative engines by (draft, k), built on first use. The k=3 engines serve several
    tests and stay; any other is dropped when the next one is asked for (memory)."""

    KEEP = {("ngram", 3), ("draft4", 3)}

    def __init__(self, draft_dir: str):
        self.drafts = {"ngram": None, "ngram_tree": None, "draft4": draft_dir, "self": loader.default_model_path()}
        self.llms: dict[tuple[str, int], LLM] = {}

    def get(self, draft: str, k: int) -> LLM:
        key = (draft, k)
        if key not in self.llms:
            for old in [o for o in self.llms if o not in self.KEEP]:
                del self.llms[old]
            gc.collect()
            self.llms[key] = LLM(**ENGINE_KW, speculative_config=spec_config(draft, k, self.drafts[draft]))
        return self.llms[key]


def spec_config(draft: str, k: int, path: str | None) -> dict:
    if draft == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    if draft == "ngram_tree":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_tree": True}
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def engines(truncated_draft_dir):
    pool = Engines(truncated_draft_dir)
    yield pool
    pool.llms.clear()


LONG_TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
    "experimented with two-wheeled machines pushed along by the rider's feet. Over the following "
    "decades pedals, chains, pneumatic tyres and lighter frames turned the curiosity into one of the "
    "most efficient means of transport ever devised. Summarize this paragraph in one sentence:"
)


@pytest.fixture(scope="module")
def prompts(plain):
    """8 prompts of 3 to ~100 tokens; some quote themselves (n-gram lookup finds matches)."""
    tok = plain.get_tokenizer()

    def chat(content):
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    def raw(text):
        return tok.encode(text, add_special_tokens=False)

    ps = [
        raw("Hello, my"),
        raw("The capital of Italy is"),
        raw("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"),
        chat("Repeat this sentence exactly three times: The quick brown fox jumps over the lazy dog."),
        chat("Name three colors."),
        chat("List the numbers from 1 to 10, separated by commas."),
        raw("Once upon a time, in a small village by the sea, there lived"),
        chat(LONG_TEXT),
    ]
    assert min(map(len, ps)) == 3 and max(map(len, ps)) < 128 - MAX_TOKENS - 5  # fits the preemption engine
    return ps


@pytest.fixture(scope="module")
def ref(plain, prompts):
    """Plain (non-speculative) greedy outputs of the 8 prompts: the reference."""
    return [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]


# ------------------------------------------------------------------ stats helpers
def stats_delta(after: SpecDecodeStats, before: SpecDecodeStats) -> SpecDecodeStats:
    def sub(a, b):
        return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]

    return SpecDecodeStats(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        num_emitted_tokens=after.num_emitted_tokens - before.num_emitted_tokens,
        num_steps=after.num_steps - before.num_steps,
        accepted_per_position=sub(after.accepted_per_position, before.accepted_per_position),
        drafted_per_position=sub(after.drafted_per_position, before.drafted_per_position),
        steps_by_draft_length=_strip_zeros(sub(after.steps_by_draft_length, before.steps_by_draft_length)),
    )


def _strip_zeros(counts: list[int]) -> list[int]:
    while counts and counts[-1] == 0:
        counts = counts[:-1]
    return counts


def check_stats(s: SpecDecodeStats, k: int, tree: bool = False) -> None:
    """Internal consistency of one SpecDecodeStats (a request's or the engine's). A tree
    may hold more drafts at position i + 1 than at i; acceptance is still a prefix."""
    assert 0.0 <= s.acceptance_rate <= 1.0
    assert s.num_steps == 0 or s.mean_acceptance_length >= 1.0
    assert len(s.drafted_per_position) <= k and len(s.accepted_per_position) == len(s.drafted_per_position)
    assert sum(s.drafted_per_position) == s.num_draft_tokens
    assert sum(s.accepted_per_position) == s.num_accepted_tokens
    assert s.num_drafts <= s.num_steps and s.num_draft_tokens <= k * s.num_drafts
    # Position i+1 is drafted (accepted) only where position i was.
    for seq in (s.accepted_per_position,) if tree else (s.drafted_per_position, s.accepted_per_position):
        assert all(a >= b for a, b in zip(seq, seq[1:])), seq
    assert all(0.0 <= r <= 1.0 for r in s.acceptance_by_position)
    assert s.num_emitted_tokens <= s.num_accepted_tokens + s.num_steps
    # Steps by draft length add up to the steps, the drafted steps and the draft tokens.
    assert sum(s.steps_by_draft_length) == s.num_steps and len(s.steps_by_draft_length) <= k + 1
    assert sum(s.steps_by_draft_length[1:]) == s.num_drafts
    assert sum(i * n for i, n in enumerate(s.steps_by_draft_length)) == s.num_draft_tokens


def snapshot(llm: LLM) -> SpecDecodeStats:
    s = llm.get_spec_decode_stats()
    return dataclasses.replace(s, accepted_per_position=list(s.accepted_per_position),
                               drafted_per_position=list(s.drafted_per_position),
                               steps_by_draft_length=list(s.steps_by_draft_length))


def run_and_check(llm: LLM, prompts, params, k: int):
    """Generate; check the per-request stats add up to the engine-wide change."""
    before = snapshot(llm)
    outs = llm.generate(prompts, params)
    delta = stats_delta(llm.get_spec_decode_stats(), before)
    total = SpecDecodeStats()
    tree = llm.engine.spec_config.prompt_lookup_tree
    for o in outs:
        check_stats(o.spec_decode_stats, k, tree)
        total.merge(o.spec_decode_stats)
    check_stats(delta, k, tree)
    assert total.as_dict() == delta.as_dict()
    return outs, delta


# ------------------------------------------------------------------ greedy == plain
# (draft, k, batch): k = 1, 3, 5 at batch 8 and k = 3 at batch 1. k = 3 at batch 8 is
# covered for both proposers by test_mixed_batch_and_seeded_determinism (its greedy
# half, on the same engines), which saves two slow runs.
GREEDY_CASES = [
    ("ngram", 1, 8), ("ngram", 3, 1), ("ngram", 5, 8), ("ngram_tree", 3, 1), ("ngram_tree", 6, 8),
    ("draft4", 1, 8), ("draft4", 5, 8), ("self", 3, 8), ("draft4", 3, 1),
]


@pytest.mark.parametrize("draft,k,batch", GREEDY_CASES, ids=[f"{d}-k{k}-b{b}" for d, k, b in GREEDY_CASES])
def test_greedy_equals_plain(engines, prompts, ref, draft, k, batch, monkeypatch):
    llm = engines.get(draft, k)
    copies = []
    real_copy = llm.engine.runner.copy_kv_slots
    monkeypatch.setattr(llm.engine.runner, "copy_kv_slots", lambda src, dst: (copies.append(len(src)), real_copy(src, dst)))
    if batch == 8:
        outs, delta = run_and_check(llm, prompts, GREEDY, k)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == ref
    else:
        delta = SpecDecodeStats()
        for i in (2, 3) if draft.startswith("ngram") else (3,):  # the code prompt and/or the "repeat this" chat, alone
            outs, d = run_and_check(llm, [prompts[i]], GREEDY, k)
            assert outs[0].outputs[0].token_ids == ref[i]
            delta.merge(d)
    assert all(len(o.outputs[0].token_ids) <= MAX_TOKENS for o in outs)
    assert delta.num_draft_tokens > 0  # the proposer really proposed
    # Every emitted token after a request's first came from a verification step
    # (all prompts are > 1 token and nothing was preempted or chunked).
    alone = (2, 3) if draft.startswith("ngram") else (3,)
    num_requests = batch if batch == 8 else len(alone)
    num_tokens = sum(len(r) for r in ref) if batch == 8 else sum(len(ref[i]) for i in alone)
    assert delta.num_emitted_tokens == num_tokens - num_requests
    if draft.startswith("ngram") and batch == 8:
        assert delta.num_accepted_tokens > 0  # the prompts that quote themselves
    if draft == "ngram_tree" and batch == 8:
        assert copies, "no branch but the first was ever accepted: the K/V copy went untested"
    if draft != "ngram_tree":
        assert not copies
    if draft == "self":
        # The target drafting for itself: everything accepted, bonus tokens every step.
        assert delta.acceptance_rate > 0.9 and delta.mean_acceptance_length > 2.5
    if draft == "draft4" and k > 1:
        assert len(delta.acceptance_by_position) == k


@pytest.mark.parametrize("int8_activations", [False, True, 3],
                         ids=["float32-activations", "int8-activations", "int8-activation-pieces"])
def test_greedy_equals_plain_in_default_dtype(prompts, int8_activations):
    """The default dtype ("auto": float16 weights with float32 activations on x86 CPUs,
    bfloat16 on GPUs) keeps the invariant too: ngram and a self-draft (every draft
    accepted, so drafting, verification and bonus tokens all run in that dtype) and the
    shipped EAGLE head. On a CPU the GGUF's own blocks are multiplied (quantized weights),
    with float32 activations or, with ``int8_activations``, rounded ones or three int8 pieces
    (where the CPU has the kernel: elsewhere the setting changes nothing and the case repeats
    the first). The pieces, the slowest setting, run with the self-draft alone: what keeps greedy
    answers is the target's verification rows, and the self-draft's are all accepted, so drafting,
    verification and bonus tokens all run in that setting."""
    kw = dict(ENGINE_KW, dtype="auto", int8_activations=int8_activations)
    plain_auto = LLM(**kw)
    if plain_auto.engine.runner.weight_dtype == torch.float16 and cpu_attention.reads_float16_cache():
        assert plain_auto.engine.runner.kv_cache_dtype == torch.float16  # so float16 K/V are covered too
    want = [o.outputs[0].token_ids for o in plain_auto.generate(prompts, GREEDY)]
    del plain_auto
    self_draft = {"method": "draft_model", "model": loader.default_model_path(), "num_speculative_tokens": 3}
    configs = [{"method": "ngram", "num_speculative_tokens": 3}, self_draft, {"method": "eagle", "num_speculative_tokens": 3}]
    for config in configs if int8_activations != 3 else [self_draft]:
        llm = LLM(**kw, speculative_config=config)
        outs, delta = run_and_check(llm, prompts, GREEDY, 3)
        assert [o.outputs[0].token_ids for o in outs] == want, config["method"]
        assert delta.num_accepted_tokens > 0
        del llm
        gc.collect()


@pytest.mark.default_dynamic_k
def test_default_free_proposers_keep_greedy_output_in_default_dtype(prompts):
    """The product's defaults: dtype "auto" and, for ngram and suffix, dynamic_k on (each
    request's draft length or tree size chosen per step, 0 included): greedy answers stay plain's."""
    kw = dict(ENGINE_KW, dtype="auto")
    plain = LLM(**kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    del plain
    for method in ("ngram", "suffix"):
        llm = LLM(**kw, speculative_config={"method": method, "num_speculative_tokens": 4})
        assert llm.engine.k_policy is not None, method
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want, method
        assert sum(llm.engine.k_policy.steps_by_k) > 0
        del llm
        gc.collect()


def test_greedy_equals_plain_in_default_dtype_wherever_prompts_are_cut(prompts):
    """A 40-token budget cuts the longer prompts into prefill chunks, and a speculative
    engine cuts them elsewhere than a plain one (its decoding requests' lookahead slots
    count against the budget); in the default dtype on a CPU every row's attention is
    independent of the cut, so greedy answers are the unchunked plain ones all the same."""
    if not cpu_attention.usable("cpu", torch.float32):
        pytest.skip("the compiled attention kernel (what makes prefill chunk-invariant) did not build")
    kw = dict(ENGINE_KW, dtype="auto")
    whole = LLM(**kw, max_num_batched_tokens=2048)
    want = [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY)]
    del whole
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(**kw, max_num_batched_tokens=40, speculative_config=spec)
        steps = []
        execute = llm.engine.runner.execute
        llm.engine.runner.execute = lambda inputs: steps.append(inputs) or execute(inputs)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want, spec
        # some prompt really was cut: a prefill chunk that ends before its prompt does
        assert any(i.num_logits == 0 for inputs in steps for i in inputs)
        del llm
        gc.collect()


def test_reduced_draft_vocabulary_is_lossless(prompts, ref, monkeypatch):
    """draft_vocab_size: the draft's LM head keeps the first 2048 token ids, so it never proposes
    the others; greedy output is still plain output, and seeded sampling reproduces itself."""
    from specserve.spec_decode.draft_model import DraftModelProposer

    proposed: list[int] = []
    propose = DraftModelProposer.propose

    def recording(self, scheduled):
        proposal = propose(self, scheduled)
        proposed.extend(t for tokens in proposal.token_ids for t in tokens)
        return proposal

    monkeypatch.setattr(DraftModelProposer, "propose", recording)
    llm = LLM(**ENGINE_KW, speculative_config={"method": "draft_model", "model": loader.default_model_path(),
                                               "num_speculative_tokens": 3, "draft_vocab_size": 2048})
    assert llm.engine.proposer.runner.model.lm_head.vocab_size == 2048
    outs, delta = run_and_check(llm, prompts, GREEDY, 3)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert proposed and max(proposed) < 2048 and delta.num_accepted_tokens > 0
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], seeded)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], seeded)] == first


def test_requantized_draft_is_lossless(prompts, ref):
    """draft_quantization: the draft (the default model, in its GGUF blocks: draft_dtype auto)
    requantized from Q4_1 to Q4_0 at load, its layer kernels rebuilt on the new blocks; greedy
    output is still plain output and its drafts are still accepted."""
    if not quant_gemm.available():
        pytest.skip("the quantized matmul kernel did not build")
    llm = LLM(**ENGINE_KW, speculative_config={"method": "draft_model", "model": loader.default_model_path(),
                                               "num_speculative_tokens": 3, "draft_dtype": "auto",
                                               "draft_quantization": "q4_0"})
    draft = llm.engine.proposer.runner.model
    assert draft.lm_head.quantized.qtypes == [2]
    assert {q for layer in draft.layers for q in layer.mlp.down_proj.quantized.qtypes} == {2}
    if draft.layer_kernels is not None:   # rebuilt: they hold the new blocks
        assert draft.layer_kernels[0]._struct.down.qtype[0] & 0xff == 2
    outs, delta = run_and_check(llm, prompts, GREEDY, 3)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert delta.num_accepted_tokens > 0


NEAR_TIE_QUESTION = ("Consider a satellite that is in a circular orbit around the Earth. The speed of the "
                     "satellite decreases. What will happen to the satellite's orbital radius and period of "
                     "revolution? Please justify your answer using principles of physics.")


def test_greedy_equals_plain_through_a_near_tie():
    """Spec-Bench question 142 in the default dtype: at token 225 the model's top two logits
    are 0.0016 apart, and with fbgemm's unpadded matmuls on an AVX2 CPU n-gram speculation
    emitted the other token there (it fails with SPECSERVE_CPU_GEMM=fbgemm
    SPECSERVE_EXACT_GEMM=0 on such a CPU). This near-tie is specific to fbgemm's bits; the
    bitwise property itself is tested at every step by test_llama's
    ``test_default_dtype_verified_rows_have_the_bits_of_decoding_alone``."""
    params = SamplingParams(temperature=0, max_tokens=232)
    messages = [{"role": "user", "content": NEAR_TIE_QUESTION}]
    kw = dict(max_model_len=512, kv_cache_memory=1 << 26)
    plain = LLM(**kw)
    want = plain.chat(messages, params)[0].outputs[0].token_ids
    del plain
    spec = LLM(**kw, speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 5})
    got = spec.chat(messages, params)[0].outputs[0].token_ids
    assert len(want) == 232
    assert got == want


# ------------------------------------------------------------------ sampling
@pytest.mark.parametrize("draft", ["draft4", "ngram", "ngram_tree"])
def test_mixed_batch_and_seeded_determinism(engines, prompts, ref, draft):
    """Greedy and seeded sampled requests in one batch: greedy ones equal plain output,
    sampled ones are reproducible (same seed -> same output) mixed with greedy ones,
    in a batch of two sampled requests, and alone."""
    llm = engines.get(draft, 3)
    # ngram rows use top-p; draft-model rows use min-p (top-p/top-k sort whole rows, slow
    # on this CPU for every draft step), so both filters meet speculation.
    filt = dict(top_p=0.9) if draft.startswith("ngram") else dict(min_p=0.05)
    sampled = lambda i: SamplingParams(temperature=0.8, seed=7 + i, max_tokens=12, **filt)  # noqa: E731
    params = [GREEDY if i % 2 == 0 else sampled(i) for i in range(len(prompts))]
    mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i in range(0, len(prompts), 2):
        assert mixed[i] == ref[i]
    odd = [1, 3]
    only_sampled = [o.outputs[0].token_ids for o in llm.generate([prompts[i] for i in odd], [params[i] for i in odd])]
    assert only_sampled == [mixed[i] for i in odd]
    assert llm.generate(prompts[odd[0]], params[odd[0]])[0].outputs[0].token_ids == mixed[odd[0]]
    assert any(mixed[i] != ref[i][:12] for i in range(1, len(prompts), 2))  # the sampled ones really sampled


def _second_tokens(llm: LLM, prompt: list[int], n: int, max_tokens: int,
                   first_seed: int | None = 0) -> tuple[list[int], list[int]]:
    """n requests seeded first_seed, first_seed + 1, ... (None: unseeded) -> (first tokens, second tokens)."""
    seeds = [None] * n if first_seed is None else range(first_seed, first_seed + n)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, ignore_eos=True) for s in seeds]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    return [o.outputs[0].token_ids[0] for o in outs], [o.outputs[0].token_ids[1] for o in outs]


def test_second_token_distribution_matches_plain(engines, plain, truncated_draft_dir):
    """Losslessness in the random path, end to end: with the 4-layer draft (which
    disagrees with the target most of the time) and temperature 1.0, the second
    generated token -- the first to go through draft and verification -- has the
    same distribution as plain decoding, on both random paths (``sample.verify``):

    - seeded requests take the target's own choice with the noise keyed by their seed
      and output index, so with the same seeds they give plain decoding's tokens
      exactly, and with other seeds the same distribution;
    - unseeded requests go through rejection sampling (accept, recover, bonus).

    300 requests per run. The first token is a plain sample in every run. Power: the
    same test tells the draft's own distribution from the target's at p ~ 1e-100
    (checked below on 100 requests), and a wrong residual or an always-accept bug
    moves the output toward it. p > 0.001 leaves a false alarm once in a thousand runs.
    """
    n = 300
    prompt = plain.get_tokenizer().encode("The best", add_special_tokens=False)
    spec = engines.get("draft4", 3)
    first_plain, second_plain = _second_tokens(plain, prompt, n, max_tokens=2)

    def counts(seeds_from):
        before = snapshot(spec)
        # max_tokens=3: with 1 token out, the scheduler leaves room for one draft token
        # (it never drafts past max_tokens - 1), so the second token is verified.
        first, second = _second_tokens(spec, prompt, n, max_tokens=3, first_seed=seeds_from)
        delta = stats_delta(spec.get_spec_decode_stats(), before)
        assert delta.num_draft_tokens == n  # exactly one verified draft per request
        assert 0 < delta.num_accepted_tokens < n  # both accepted drafts and recovered tokens happened
        return first, second

    first_same, second_same = counts(0)          # the plain run's seeds
    assert np.mean(np.array(first_same) == np.array(first_plain)) > 0.99
    assert np.mean(np.array(second_same) == np.array(second_plain)) > 0.99
    for seeds_from in (n, None):                 # other seeds; unseeded (rejection sampling)
        _, second_spec = counts(seeds_from)
        p = _chi_square_p(second_plain, second_spec)
        assert p > 1e-3, (seeds_from, p, collections.Counter(second_plain).most_common(8),
                          collections.Counter(second_spec).most_common(8))

    # The test has power: the draft's own second-token distribution is clearly rejected.
    draft_only = LLM(model=truncated_draft_dir, dtype="float32", max_model_len=512, kv_cache_memory=1 << 24)
    _, second_draft = _second_tokens(draft_only, prompt, 100, max_tokens=2)
    assert _chi_square_p(second_plain, second_draft) < 1e-6


# ------------------------------------------------------------------ limits
def test_near_max_tokens_gets_fewer_drafts(engines, prompts, ref):
    k = 3
    llm = engines.get("draft4", k)
    i = next(i for i, r in enumerate(ref) if len(r) == MAX_TOKENS)
    limits = [1, 2, 3, 4, 5]
    outs = llm.generate([prompts[i]] * len(limits),
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in limits])
    for m, out in zip(limits, outs):
        tokens, stats = out.outputs[0].token_ids, out.spec_decode_stats
        assert tokens == ref[i][:m] and out.outputs[0].finish_reason == "length"
        # After j tokens the scheduler drafts at most min(k, m - j - 1): never past max_tokens.
        assert len(stats.drafted_per_position) <= max(0, min(k, m - 2))
        assert stats.num_emitted_tokens == m - 1
        if m <= 2:
            assert stats.num_drafts == 0


@pytest.mark.parametrize("draft", ["draft4", "ngram_tree"])
def test_greedy_equals_plain_under_preemption(prompts, ref, truncated_draft_dir, draft):
    # 12 blocks of 16 tokens: one request of max_model_len=128 (+3 lookahead slots)
    # fits, the 8 prompts (3-100 tokens, +16 new) do not: preemption and recompute,
    # for the target's and the draft's cache alike. (The draft model is the harder
    # case: its own KV and proposer_num_computed_tokens must be rebuilt too; a tree's
    # pending branch must never outlive a preemption.)
    llm = LLM(dtype="float32", max_model_len=128, kv_cache_memory=12 * BYTES_PER_BLOCK_FP32,
              speculative_config=spec_config(draft, 3, truncated_draft_dir))
    assert llm.engine.kv_cache.num_blocks == 12
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_cache.num_free_blocks == 12
    assert llm.get_spec_decode_stats().num_draft_tokens > 0


# ------------------------------------------------------------------ configuration errors
def test_vocabulary_mismatch_selects_the_cross_vocabulary_path(tmp_path, shared_weights, caplog):
    """A draft whose vocabulary differs from the target's (here 1,000 ids against 49,152) is no
    longer refused: the start-up check selects the cross-vocabulary path and says so in a log line
    naming both sizes (docs/speculative_decoding.md; its own tests are tests/spec_decode/)."""
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    from specserve.spec_decode.cross_vocab import CrossVocabProposer

    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    shared_weights(None, torch.float32, load_weights=False).tokenizer.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="specserve.spec_decode.checks"):
        llm = LLM(dtype="float32", max_model_len=128, kv_cache_memory=12 * BYTES_PER_BLOCK_FP32,
                  speculative_model=str(tmp_path), num_speculative_tokens=2)
    assert isinstance(llm.engine.proposer, CrossVocabProposer)
    assert any("across vocabularies" in r.getMessage() and "1000" in r.getMessage() and "49152" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("k", [0, -1, 100])
def test_invalid_num_speculative_tokens(shared_weights, truncated_draft_dir, k):
    calls = shared_weights.calls
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": k})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(dtype="float32", speculative_model=truncated_draft_dir, num_speculative_tokens=k)
    assert shared_weights.calls == calls  # rejected before any model was loaded
