"""Tensor parallelism on CPU (gloo).

1. The sharded layers against full ones, every rank simulated in this process
   (no process group): column/row-parallel linears, vocab-parallel embedding and
   LM head, and a whole tiny Llama whose ranks run as threads exchanging tensors
   through a fake group.
2. Real process groups: the default model (SmolLM2-135M: 9 heads, 3 kv heads,
   split 6 + 3 / 2 + 1 over 2 ranks) at TP 2 gives TP 1's greedy tokens in
   float32, without speculation, with n-gram and with a draft at TP 1 and at
   TP 2; no process outlives ``del llm``; a worker killed mid-generation raises
   quickly; start-up errors (more ranks than KV heads, bad draft TP) are clear.
3. Lifetimes and launches on a tiny random model (fast to start): Ctrl-C or
   SIGKILL of the driver leaves no worker behind; a torchrun-style launch
   (MASTER_ADDR/PORT, RANK, WORLD_SIZE) of the same script on two ranks works.
"""
from __future__ import annotations

import dataclasses

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig

from specserve import LLM, SamplingParams, SpeculativeConfig
from specserve.distributed.launcher import WorkerError
from specserve.distributed.parallel_state import TensorParallelGroup
from specserve.model_executor import loader
from specserve.model_executor.layers import quant_gemm
from specserve.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from specserve.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from specserve.worker.model_runner import ForwardInput, ModelRunner
from specserve.worker.tp_executor import BlockTableDeltas

from model_cache import cached_model_loads

TP = 2  # the default model's 3 kv heads (and their 9 query heads) split unevenly: 2 + 1
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory=1 << 25)


# =========================================================================== 1. simulated ranks


class _Done:
    def wait(self):
        return True


class _NoReduce:
    """A group whose collectives do nothing: each rank's partial result stays local."""

    def allreduce(self, tensors):
        return _Done()


def ranks(n: int, group=None) -> list[TensorParallelGroup]:
    return [TensorParallelGroup(r, n, group) for r in range(n)]


def test_shard_deals_units_out_evenly():
    # 3 KV heads of 64 over 2 ranks: 2 + 1 heads; 9 query heads follow their KV heads (6 + 3).
    assert [TensorParallelGroup(r, 2).shard(3 * 64, "kv", 3) for r in range(2)] == [(0, 128), (128, 64)]
    assert [TensorParallelGroup(r, 2).shard(9 * 64, "q", 3) for r in range(2)] == [(0, 384), (384, 192)]
    assert [TensorParallelGroup(r, 4).shard(10, "x") for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    with pytest.raises(ValueError, match="smaller than the tensor-parallel size 4"):
        TensorParallelGroup(0, 4).shard(3 * 64, "num_key_value_heads", 3)


@pytest.mark.parametrize("n,units", [(1, None), (2, None), (3, None), (4, 3), (2, 3)])
def test_column_parallel_matches_full_linear(n, units):
    """Even and uneven splits (n=4 over 12 rows; 3 units of 4 rows over 2 ranks)."""
    if units is not None and units < n:
        units = None
    torch.manual_seed(0)
    q, kv = torch.randn(12, 10), torch.randn(6, 10)   # two fused outputs, each sharded on its own
    bq, bkv = torch.randn(12), torch.randn(6)
    x = torch.randn(5, 10)
    full = torch.cat([F.linear(x, q, bq), F.linear(x, kv, bkv)], dim=-1)
    outs = []
    for tp in ranks(n):
        layer = ColumnParallelLinear(10, [12, 6], bias=True, tp=tp, num_units=units)
        layer.load([q, kv], [bq, bkv])
        outs.append(layer(x).split(layer.shard_sizes, dim=-1))
    # Rank r holds its slice of q's rows and likewise of kv's.
    got = torch.cat([torch.cat([o[0] for o in outs], -1), torch.cat([o[1] for o in outs], -1)], -1)
    torch.testing.assert_close(got, full)


@pytest.mark.parametrize("n,units", [(1, None), (2, None), (3, None), (2, 3), (5, None)])
def test_row_parallel_matches_full_linear(n, units):
    torch.manual_seed(1)
    w, b = torch.randn(7, 12), torch.randn(7)
    x = torch.randn(5, 12)
    partials = []
    for tp in ranks(n, _NoReduce()):
        layer = RowParallelLinear(12, 7, bias=True, tp=tp, num_units=units)
        layer.load(w, b)
        start, length = tp.shard(12, "in", units)
        partials.append(layer(x[:, start : start + length]))   # partial sum + bias (added once per rank)
    got = sum(partials) - (n - 1) * b
    torch.testing.assert_close(got, F.linear(x, w, b))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_vocab_parallel_embedding_and_lm_head(n):
    torch.manual_seed(2)
    vocab, hidden = 101, 8                       # 101 is not divisible by 2 or 3: padded rows
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 5, 50, 99, 100, 33])
    h = torch.randn(4, hidden)
    embeds, logits = [], []
    for tp in ranks(n, _NoReduce()):
        emb = VocabParallelEmbedding(vocab, hidden, tp)
        emb.load(table)
        embeds.append(emb(ids))                  # rows this rank does not hold are zero
        head = ParallelLMHead(vocab, hidden, tp)
        head.load(table)
        logits.append(F.linear(h, head.weight))  # this rank's vocab slice of the logits
    torch.testing.assert_close(sum(embeds), F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], F.linear(h, table))


@pytest.mark.slow
@pytest.mark.skipif(not quant_gemm.available(), reason="the quantized matmul kernel did not build here")
@pytest.mark.parametrize("int8", [False, True])
def test_quantized_shards_carry_the_activation_setting(int8):
    """Each rank's share of the GGUF blocks keeps ``int8_activations`` (rows for
    column-parallel layers, whole blocks for row-parallel ones)."""
    from specserve.worker.tp_executor import shard_parameters

    loaded = loader.load_model(None, torch.float16, keep_quantized=True, int8_activations=int8)
    for rank in (0, 1):
        _, quantized = shard_parameters(loaded.config, loaded.state_dict, torch.float16, rank, 2)
        assert quantized and all(flag is int8 for _, _, flag in quantized.values())


class ThreadGroup:
    """N ranks as N threads of one process; collectives go through shared slots."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * n

    def member(self, rank: int) -> "_Member":
        return _Member(self, rank)


class _Member:
    def __init__(self, shared: ThreadGroup, rank: int):
        self.shared, self.rank = shared, rank

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        s = self.shared
        s.slots[self.rank] = x.clone()
        s.barrier.wait()
        parts = list(s.slots)
        s.barrier.wait()
        return parts

    def allreduce(self, tensors):
        parts = self._exchange(tensors[0])
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        tensors[0].copy_(total)
        return _Done()

    def allgather(self, outputs, inputs):
        for out, part in zip(outputs[0], self._exchange(inputs[0])):
            out.copy_(part)
        return _Done()

    def gather(self, outputs, inputs, opts):
        parts = self._exchange(inputs[0])
        if outputs:
            for out, part in zip(outputs[0], parts):
                out.copy_(part)
        return _Done()


def _tiny_llama_state(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_model_matches_unsharded_with_ranks_as_threads(n):
    """A whole model (heads, kv heads, MLP and vocab sharded, a per-rank KV cache) over
    prefill + decode steps: rank 0's logits equal the unsharded model's. At n=4 the
    6 KV heads split unevenly (2 + 2 + 1 + 1), and the query heads with them."""
    config = LlamaConfig(vocab_size=101, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=256)
    config.architectures = ["LlamaForCausalLM"]
    state = _tiny_llama_state(config, seed=n)
    steps = [
        [ForwardInput(list(range(3, 23)), 0, [0, 1], 2), ForwardInput(list(range(40, 47)), 0, [2], 7)],
        [ForwardInput([7], 20, [0, 1], 1), ForwardInput([9, 11, 13], 7, [2], 3)],
    ]
    _ranks_as_threads_match_unsharded(config, state, steps, n)


@pytest.mark.parametrize("family", ["qwen3", "olmo2", "gemma3", "mistral"])
def test_family_with_qk_norms_or_sliding_windows_sharded_matches_unsharded(family):
    """TP 2 == TP 1 where the families differ most: per-head q/k norms (Qwen3, Gemma 3), q/k norms
    over the whole projection, summed over ranks (OLMo 2), sliding windows (Gemma 3, Mistral),
    with contexts past the window (16)."""
    from model_families import tiny_model

    hf = tiny_model(family, seed=3)
    config = hf.config
    config.architectures = [type(hf).__name__]
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    steps = [
        [ForwardInput(list(range(3, 43)), 0, [0, 1, 2], 2), ForwardInput(list(range(40, 47)), 0, [3], 7)],
        [ForwardInput([7], 40, [0, 1, 2], 1), ForwardInput([9, 11, 13], 7, [3], 3)],
    ]
    _ranks_as_threads_match_unsharded(config, state, steps, 2)


@pytest.mark.parametrize("n", [2, 3])
def test_lora_adapters_sharded_match_unsharded_with_ranks_as_threads(n):
    """LoRA adapters on every projection (column-parallel: B's rows shared out; row-parallel: A's
    columns, summed by the base's all-reduce), two adapters and base rows in one step."""
    from specserve.lora.peft_adapter import expected_shapes

    config = LlamaConfig(vocab_size=101, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=256)
    config.architectures = ["LlamaForCausalLM"]
    state = _tiny_llama_state(config, seed=7)
    g = torch.Generator().manual_seed(n)
    loras = {}
    for adapter_id, projs in ((1, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
                              (2, ("v_proj", "down_proj"))):
        loras[adapter_id] = {(layer, proj): (0.1 * torch.randn(4, i, generator=g), 0.1 * torch.randn(o, 4, generator=g))
                             for layer in range(2) for proj, (o, i) in expected_shapes(config).items() if proj in projs}
    steps = [
        [ForwardInput(list(range(3, 23)), 0, [0, 1], 2, lora_id=1), ForwardInput(list(range(40, 47)), 0, [2], 7),
         ForwardInput(list(range(50, 55)), 0, [3], 1, lora_id=2)],
        [ForwardInput([7], 20, [0, 1], 1, lora_id=1), ForwardInput([9, 11, 13], 7, [2], 3),
         ForwardInput([5], 5, [3], 1, lora_id=2)],
    ]
    _ranks_as_threads_match_unsharded(config, state, steps, n, loras)


def _ranks_as_threads_match_unsharded(config, state, steps, n, loras: dict | None = None):
    """Run ``steps`` unsharded and on ``n`` ranks (threads): rank 0's logits equal the unsharded ones
    (``loras``: {adapter id: its modules} added to every runner)."""
    def run(tp):
        runner = ModelRunner(config, state, torch.float32, torch.device("cpu"), 256, 16, tp=tp)
        if loras:
            runner.enable_lora()
            for adapter_id, modules in loras.items():
                runner.add_lora(adapter_id, modules)
        runner.allocate_kv_cache(4)
        return [runner.execute(step).logits for step in steps]

    expected = run(TensorParallelGroup())
    shared = ThreadGroup(n)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def rank_main(rank):
        try:
            results[rank] = run(TensorParallelGroup(rank, n, shared.member(rank)))
        except BaseException as e:  # surface thread failures in the test
            errors.append(e)
            shared.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(logits is None for logits in results[1])   # only rank 0 gets logits
    for got, want in zip(results[0], expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if loras:   # the adapters changed the adapted rows
        plain = ModelRunner(config, state, torch.float32, torch.device("cpu"), 256, 16)
        plain.allocate_kv_cache(4)
        base_step = [dataclasses.replace(i, lora_id=0) for i in steps[0]]
        assert not torch.allclose(plain.execute(base_step).logits[:2], expected[0][:2], atol=1e-3)


def test_block_table_deltas_round_trip():
    enc, dec = BlockTableDeltas(), BlockTableDeltas()
    tables = {"a": [3, 4], "b": [9]}
    sent = 0
    for step in range(30):
        if step == 10:
            tables["c"] = [20, 21, 22]
        if step == 15:
            del tables["b"]
        if step == 20:
            tables["a"] = [3, 30]          # preempted and re-admitted: same first block, new tail
        for t in tables.values():
            if step % 4 == 0:
                t.append(max(t) + 100)
        inputs = [ForwardInput([step], step, list(t), 1) for t in tables.values()]
        rows = enc.encode(inputs)
        sent += sum(len(r[5]) for r in rows)
        assert dec.decode(rows) == inputs
    assert sent < 30 * 3   # deltas, not whole tables every step


# =========================================================================== 2. real process groups


@pytest.fixture(scope="module", autouse=True)
def shared_weights():
    """Load each model once for the module (the driver loads; workers get shards from it)."""
    with cached_model_loads():
        yield


class one_thread:
    """TP 1 with one thread: on a small shared CPU, two OpenMP threads can be 10x slower."""

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference():
    with one_thread():
        llm = LLM(**ENGINE)
        out = token_ids(llm.generate(PROMPTS, GREEDY))
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    del llm
    return out, weight_bytes


SPEC_CASES = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_tree": True},
    "draft_tp1": {"num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
    "draft_tpN": {"num_speculative_tokens": 3, "draft_tensor_parallel_size": TP},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_tp_greedy_equals_tp1_and_leaves_no_process(case, reference, truncated_draft_dir):
    ref_tokens, full_bytes = reference
    spec = SPEC_CASES[case]
    if spec is not None and spec.get("method") != "ngram":
        spec = {**spec, "model": truncated_draft_dir}
    llm = LLM(tensor_parallel_size=TP, speculative_config=spec, **ENGINE)
    runner = llm.engine.runner
    pids = runner.worker_pids
    assert len(pids) == TP - 1 and all(_alive(p) for p in pids)
    # Each rank holds about half the weights: rank 0 has 2 of the 3 KV heads' attention
    # weights (about 0.53 of the whole model), rank 1 the rest; norms are replicated.
    assert max(runner.weight_bytes_per_rank) < 0.56 * full_bytes, runner.weight_bytes_per_rank
    assert sum(runner.weight_bytes_per_rank) < 1.01 * full_bytes, runner.weight_bytes_per_rank
    if case == "draft_tp1":
        assert type(llm.engine.proposer.runner) is ModelRunner       # in the driver process only
    if case == "draft_tpN":
        assert llm.engine.proposer.runner.worker_pids == pids         # sharded over the same workers
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == ref_tokens
    if spec is not None:
        assert llm.get_spec_decode_stats().as_dict()["num_draft_tokens"] > 0
    # Prefix caching under TP: resend each prompt with its first 12 answer tokens; the first
    # block comes from the cache, and greedy decoding goes on exactly as before.
    tok = llm.get_tokenizer()
    full = [i for i, r in enumerate(ref_tokens) if len(r) == 16]
    resent = [tok.encode(PROMPTS[i], add_special_tokens=False) + ref_tokens[i][:12] for i in full]
    hits = llm.get_prefix_cache_stats()["hits"]
    assert token_ids(llm.generate(resent, SamplingParams(temperature=0, max_tokens=4))) == \
        [ref_tokens[i][12:] for i in full]
    assert llm.get_prefix_cache_stats()["hits"] >= hits + 16 * len(full) > hits
    del llm, runner
    gc.collect()
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_vllm_draft_model_call_runs_verbatim(reference, truncated_draft_dir):
    """vLLM's original draft-model interface, as its docs write it (TP 2 on gloo here): the draft
    at TP 1 in the driver, the target sharded, greedy output equal to TP 1 plain."""
    ref_tokens, _ = reference
    llm = LLM(model=None, speculative_model=truncated_draft_dir, tensor_parallel_size=2,
              speculative_model_uses_tp_1=True, num_speculative_tokens=3, **ENGINE)
    assert type(llm.engine.proposer.runner) is ModelRunner          # the draft in the driver only
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == ref_tokens
    assert llm.get_spec_decode_stats().as_dict()["num_draft_tokens"] > 0
    pids = llm.engine.runner.worker_pids
    del llm
    gc.collect()
    assert wait_gone(pids) == []


def test_vllm_draft_tp_spellings_set_draft_tensor_parallel_size():
    from specserve.entrypoints.llm import _draft_tp_from_vllm_spellings

    assert _draft_tp_from_vllm_spellings(True, None, 4) == 1
    assert _draft_tp_from_vllm_spellings(False, None, 4) == 4
    assert _draft_tp_from_vllm_spellings(None, 1, 4) == 1
    assert _draft_tp_from_vllm_spellings(None, None, 4) is None
    with pytest.raises(ValueError, match="disagree"):
        _draft_tp_from_vllm_spellings(True, 4, 4)


@pytest.mark.slow
@pytest.mark.default_dynamic_k
def test_tp_with_ngram_defaults_equals_tp1(reference):
    """n-gram's default, dynamic_k on: the policy calibrates and times the sharded forward."""
    llm = LLM(tensor_parallel_size=TP, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **ENGINE)
    assert llm.engine.k_policy is not None and llm.engine.k_policy.forward.known()
    pids = llm.engine.runner.worker_pids
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == reference[0]
    assert sum(llm.engine.k_policy.steps_by_k) > 0
    del llm
    gc.collect()
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_tp_in_the_default_dtype_equals_tp1():
    """dtype="auto" on a CPU: the GGUF's blocks cut along whole blocks travel to the ranks
    as they are (norms and biases in float16), and each worker puts the dense tensors in the
    compute dtype as the driver does (once, a worker kept float16 norms and embeddings and
    the first all-reduce failed on mismatched sizes)."""
    auto = dict(ENGINE, dtype="auto")
    with one_thread():
        single = LLM(**auto)
        want = token_ids(single.generate(PROMPTS, GREEDY))
    del single
    llm = LLM(tensor_parallel_size=TP, **auto)
    if quant_gemm.available():   # every rank holds its share of the blocks, not float16 copies
        assert llm.engine.runner.model.layers[0].mlp.down_proj.quantized is not None
        file_bytes = os.path.getsize(loader.default_model_path())
        assert all(b < 0.75 * file_bytes for b in llm.engine.runner.weight_bytes_per_rank), \
            llm.engine.runner.weight_bytes_per_rank
    pids = llm.engine.runner.worker_pids
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == want
    del llm
    gc.collect()
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_more_ranks_than_kv_heads_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .*num_key_value_heads=3.*Sizes that work for it: 1 to 3"):
        LLM(tensor_parallel_size=4, **ENGINE)


def test_invalid_draft_tensor_parallel_size():
    for tp, draft_tp in [(3, 2), (1, 2)]:
        with pytest.raises(ValueError, match=f"draft_tensor_parallel_size={draft_tp} is not supported"):
            LLM(tensor_parallel_size=tp, speculative_config={"method": "ngram", "draft_tensor_parallel_size": draft_tp},
                **ENGINE)
    with pytest.raises(ValueError, match="positive integer"):
        SpeculativeConfig(method="ngram", draft_tensor_parallel_size=0)


# =========================================================================== 3. tiny model: lifetimes, launches


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama (4 heads, 2 kv heads) with the default tokenizer: starts fast."""
    folder = str(tmp_path_factory.mktemp("tiny_llama"))
    tokenizer = loader.load_model(None, torch.float32, load_weights=False).tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    config.architectures = ["LlamaForCausalLM"]
    state = _tiny_llama_state(config, seed=0)
    state.pop("lm_head.weight", None)
    save_file(state, os.path.join(folder, "model.safetensors"))
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


TINY = dict(dtype="float32", max_model_len=2048, kv_cache_memory=1 << 24)


@pytest.mark.slow
def test_lora_at_tp_2_equals_tp_1(tiny_model_dir, tmp_path):
    """Adapters reach the worker ranks (each keeps its shard) and mixed steps run there."""
    from lora_adapters import write_peft_adapter
    from specserve import LoRARequest

    loras = [LoRARequest("a", 1, write_peft_adapter(tiny_model_dir, str(tmp_path / "a"), seed=1)), None,
             LoRARequest("b", 2, write_peft_adapter(tiny_model_dir, str(tmp_path / "b"), seed=2,
                                                    target_modules=("k_proj", "o_proj", "gate_proj", "up_proj")))]
    prompts = ["Hello there", "Hello there", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=10)
    want = token_ids(LLM(model=tiny_model_dir, enable_lora=True, max_loras=2, **TINY).generate(
        prompts, params, lora_request=loras))
    llm = LLM(model=tiny_model_dir, tensor_parallel_size=2, enable_lora=True, max_loras=2, **TINY)
    try:
        assert token_ids(llm.generate(prompts, params, lora_request=loras)) == want
        assert want[0] != want[1]
    finally:
        llm.engine.runner.shutdown()


@pytest.mark.slow
def test_killed_worker_raises_quickly_instead_of_hanging(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, tensor_parallel_size=2, **TINY)
    pids = llm.engine.runner.worker_pids
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    killer = threading.Timer(2.0, os.kill, (pids[0], signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(WorkerError, match=r"rank 1 .*SIGKILL"):
            llm.generate(["Once upon a time"] * 4, long)
    finally:
        killer.cancel()
    assert time.monotonic() - start < 30
    with pytest.raises(WorkerError):   # the engine stays failed, it does not hang
        llm.generate("again", GREEDY)
    del llm
    gc.collect()
    assert wait_gone(pids) == []


_DRIVER_SCRIPT = textwrap.dedent(
    """
    import json, signal, sys
    from specserve import LLM, SamplingParams

    if __name__ == "__main__":
        # Ctrl-C as in a terminal. A process started with SIGINT ignored (pytest run as a
        # background job of a non-interactive shell, under nohup, by some CI runners) passes
        # SIG_IGN on to this one, and Python then installs no KeyboardInterrupt handler:
        # the test's SIGINT would be dropped and the driver would loop until the guard.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, kv_cache_memory=1 << 24,
                  tensor_parallel_size=2)
        if sys.argv[2] == "loop":
            print(json.dumps(llm.engine.runner.worker_pids), flush=True)
            while True:
                llm.generate(["hello"] * 2, SamplingParams(temperature=0, max_tokens=64))
        out = llm.generate(sys.argv[3:], SamplingParams(temperature=0, max_tokens=8))
        print(json.dumps([o.outputs[0].token_ids for o in out]), flush=True)
    """
)


@pytest.fixture(scope="module")
def driver_script(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("scripts") / "tp_driver.py"
    path.write_text(_DRIVER_SCRIPT)
    return str(path)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl_c", "driver_killed"])
def test_driver_exit_leaves_no_worker(sig, tiny_model_dir, driver_script):
    proc = subprocess.Popen([sys.executable, driver_script, tiny_model_dir, "loop"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_clean_env())
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        pids = json.loads(line)
        time.sleep(1.0)   # generating
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert proc.returncode != 0
        assert wait_gone(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_style_launch_of_one_script_on_two_ranks(tiny_model_dir, driver_script):
    prompts = ["Hello there", "1 2 3"]
    with one_thread():
        ref = token_ids(LLM(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory=1 << 24)
                        .generate(prompts, SamplingParams(temperature=0, max_tokens=8)))
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**_clean_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, driver_script, tiny_model_dir, "once", *prompts],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert json.loads(outs[0][0].strip().splitlines()[-1]) == ref
    assert outs[1][0].strip() == ""   # rank 1 served as a worker and exited with the driver


_UNGUARDED_SCRIPT = textwrap.dedent(
    """
    import sys

    from specserve import LLM

    # No `if __name__ == "__main__":` guard: each spawned worker imports this file again.
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, kv_cache_memory=1 << 24,
              tensor_parallel_size=2)
    print("built", flush=True)
    """
)


@pytest.mark.slow
def test_a_script_without_a_main_guard_gets_one_clear_error(tiny_model_dir, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), tiny_model_dir], capture_output=True, text=True,
                          env=_clean_env(), timeout=180)
    assert proc.returncode == 1 and "built" not in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: tensor_parallel_size > 1 starts its worker processes"), proc.stderr[-3000:]
    assert 'under `if __name__ == "__main__":`' in last and "torchrun" in last
    # The worker exits quietly: no bootstrapping traceback of its own, no "exited with code".
    assert proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]
    assert "bootstrapping phase" not in proc.stderr and "exited with code" not in proc.stderr
