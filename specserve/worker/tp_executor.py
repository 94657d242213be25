"""Tensor parallelism for the engine: the driver's executor and the workers' loop.

``TensorParallelExecutor`` has the part of ``ModelRunner``'s interface the engine
and the proposers use (``execute``, ``allocate_kv_cache``, ``bytes_per_block``,
``num_blocks``, ``device``, ``dtype``, ``config``, ``model``), so the engine only
chooses which one to build (``build_executor``). Rank 0 (the driver, this
process) runs the engine; each step it sends the step's ``ForwardInput`` list to
every worker, then every rank runs the same forward on its shard: row-parallel
layers all-reduce, the LM head gathers its shards on rank 0, which alone gets
logits.

What travels per step: the new token ids, start positions and logit counts of
each request, and its block table as a delta against the previous step's
(``BlockTableDeltas``): a decoding request sends nothing of its table until it
grows by a block. Weights travel once, at start-up: the driver loads the
checkpoint, cuts each worker's shard with the layers' own ``load`` code, and
sends it tensor by tensor, so a worker never holds (or even reads) the full
checkpoint.

A draft model runs either at TP 1, in the driver process only (a plain
``ModelRunner``), or at the target's TP, sharded over the same workers (a
second executor, ``add_model``, on the same process group).
"""
from __future__ import annotations

import gc
import logging
import pickle
import resource
from multiprocessing.connection import Connection
from types import SimpleNamespace

import torch

from specserve.distributed.launcher import (
    WorkerError,
    WorkerGroup,
    env_launch,
    exit_if_bootstrapping,
    run_env_worker,
    startup_timeout_s,
)
from specserve.distributed.parallel_state import TensorParallelGroup
from specserve.model_executor.layers.fp16_gemm import skip_row_padding
from specserve.model_executor.layers.quantized import QuantizedMatrix, QuantSegment
from specserve.model_executor.models.registry import get_model_class
from specserve.worker.model_runner import ForwardInput, ForwardOutput, ModelRunner

logger = logging.getLogger(__name__)

TARGET, DRAFT = "target", "draft"

__all__ = [
    "TensorParallelExecutor", "WorkerError", "build_executor", "build_draft_runner", "prepare_parallelism",
    "check_tp_splittable", "validate_parallel_config",
]


# --------------------------------------------------------------------------- checks


def check_tp_splittable(config, tp: int, what: str = "the model", name: str = "") -> None:
    """Each rank must hold at least one whole KV head (with its query heads).

    Heads need not divide evenly: 3 KV heads on 2 ranks are split 2 + 1
    (TensorParallelGroup.shard), so the default model runs at TP 2 and 3.
    """
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    label = f"{what} {name!r}" if name else what
    if heads % kv_heads:
        raise ValueError(f"{label}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if kv_heads < tp:
        raise ValueError(
            f"tensor_parallel_size={tp} is larger than {label}'s num_key_value_heads={kv_heads} "
            f"(num_attention_heads={heads}): every rank needs at least one whole KV head. "
            f"Sizes that work for it: 1 to {kv_heads}"
        )


def validate_parallel_config(config, spec) -> None:
    """draft_tensor_parallel_size must be 1 (driver only) or the target's TP (unset = 1)."""
    tp = config.tensor_parallel_size
    draft_tp = getattr(spec, "draft_tensor_parallel_size", None) if spec is not None else None
    if draft_tp is not None and draft_tp not in (1, tp):
        choices = "1" if tp == 1 else f"1 (the draft runs in the driver process only) or {tp} (the target's)"
        raise ValueError(
            f"draft_tensor_parallel_size={draft_tp} is not supported with tensor_parallel_size={tp}; choose {choices}"
        )


def prepare_parallelism(config, spec) -> None:
    """Start-up checks the engine runs first, and the torchrun-style worker switch.

    In a torchrun-style launch every rank runs the same program; on RANK > 0 the
    engine's constructor turns this process into a worker, serves the driver
    until it shuts down, and exits the process (SystemExit(0)).
    """
    validate_parallel_config(config, spec)
    if config.tensor_parallel_size == 1:
        return
    env = env_launch()
    if env is None:
        exit_if_bootstrapping()   # before loading anything: an unguarded script re-imported by a worker
    if env is not None and env.rank != 0:
        if env.world_size != config.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size} but WORLD_SIZE={env.world_size}; they must match"
            )
        run_env_worker(serve)
        raise SystemExit(0)


def build_executor(config, loaded, dtype: torch.dtype, device: torch.device, max_model_len: int):
    """The target's runner: a ModelRunner at TP 1, else a TensorParallelExecutor."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return ModelRunner(loaded.config, loaded.state_dict, dtype, device, max_model_len, config.block_size)
    check_tp_splittable(loaded.config, tp, "the target", loaded.name)
    return TensorParallelExecutor.start(
        tp, loaded.config, loaded.state_dict, dtype, device, max_model_len, config.block_size
    )


def build_draft_runner(loaded, dtype: torch.dtype, device, max_model_len: int, block_size: int,
                       target_executor: "TensorParallelExecutor | None" = None):
    """The draft model's runner: TP 1 in this (the driver's) process, or, given the target's
    ``target_executor``, sharded like the target over the same ranks."""
    if target_executor is None:
        runner = ModelRunner(loaded.config, loaded.state_dict, dtype, device, max_model_len, block_size)
        skip_row_padding(runner.model)
        return runner
    check_tp_splittable(loaded.config, target_executor.group.world_size, "the draft", loaded.name)
    return target_executor.add_model(DRAFT, loaded.config, loaded.state_dict, dtype, max_model_len)


# --------------------------------------------------------------------------- what travels


class BlockTableDeltas:
    """Block tables sent as deltas against the previous message's, keyed by first block.

    Tables only grow (or are freed whole), so a request usually sends
    ``(first_block, len(previous), new blocks)``. The driver's encoder and a
    worker's decoder apply the same rules to the same message sequence, so
    their memories stay equal; a table that is not an extension (preemption
    reused its first block) is resent from the longest common prefix.
    """

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def encode(self, inputs: list[ForwardInput]) -> list[tuple]:
        rows, seen = [], {}
        for inp in inputs:
            table = inp.block_table
            first = table[0] if table else -1
            prev = self.tables.get(first)
            keep = 0
            if prev is not None:
                if len(prev) <= len(table) and table[: len(prev)] == prev:
                    keep = len(prev)
                else:
                    for a, b in zip(prev, table):
                        if a != b:
                            break
                        keep += 1
            rows.append((inp.token_ids, inp.start_position, inp.num_logits, first, keep, table[keep:], inp.tree_parents,
                         inp.lora_id))
            seen[first] = list(table)
        self.tables = seen
        return rows

    def decode(self, rows: list[tuple]) -> list[ForwardInput]:
        inputs, seen = [], {}
        for token_ids, start, num_logits, first, keep, tail, tree_parents, lora_id in rows:
            table = self.tables[first][:keep] + list(tail) if keep else list(tail)
            seen[first] = table
            inputs.append(ForwardInput(list(token_ids), start, table, num_logits, tree_parents, lora_id=lora_id))
        self.tables = seen
        return inputs


# ModelRunner methods the driver runs on every rank with the same arguments, answered by nothing
RANK_CALLS = ("copy_kv_slots", "enable_lora", "add_lora", "remove_lora")

QUANTIZED_SUFFIX = ".quantized."   # shard entry "<module>.quantized.<i>": segment i of a QuantizedMatrix


def shard_parameters(config, state_dict: dict, dtype: torch.dtype, rank: int, world_size: int):
    """Rank ``rank``'s parameters, cut by the layers' own ``load`` (no process group needed).

    Returns (tensors, quantized): tensors by name, with each quantized layer's segments as
    "<module>.quantized.<i>" [rows, row_bytes] uint8 (its ``weight`` is an empty placeholder),
    and per quantized module (in_features, [ggml type of each segment], int8 activations)."""
    model = get_model_class(config)(config, tp=TensorParallelGroup(rank, world_size, None), max_positions=1)
    model.load_weights({name: t.to(dtype) for name, t in state_dict.items()})
    tensors = {name: p.data for name, p in model.named_parameters()}
    quantized = {}
    for name, module in model.named_modules():
        matrix = getattr(module, "quantized", None)
        if matrix is not None:
            quantized[name] = (matrix.in_features, matrix.qtypes, matrix.int8_activations)
            del tensors[f"{name}.weight"]   # the empty placeholder does not travel
            for i, seg in enumerate(matrix.segments):
                tensors[f"{name}{QUANTIZED_SUFFIX}{i}"] = seg.data.contiguous()
    return tensors, quantized


def plain_config(config):
    """The model config as plain attributes: a worker unpickles it without importing transformers."""
    to_dict = getattr(config, "to_dict", None)
    return SimpleNamespace(**to_dict()) if to_dict is not None else config


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights: its parameters and the GGUF blocks of its quantized layers."""
    quantized = sum(m.quantized.nbytes for m in model.modules() if getattr(m, "quantized", None) is not None)
    return sum(p.numel() * p.element_size() for p in model.parameters()) + quantized


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM: for a spawned worker, ru_maxrss would
    include the parent's memory at fork time, before exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def _recv_tensor(conn: Connection, shape, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    if t.numel():
        n = conn.recv_bytes_into(_as_bytes(t))
        if n != t.numel() * t.element_size():
            raise ValueError(f"expected {t.numel() * t.element_size()} bytes of weights, got {n}")
    return t


class _ShardRunner(ModelRunner):
    """A worker's ModelRunner: its weights arrive already sharded from the driver, in the
    weights' dtype (half the bytes to send for float16), and are put in the compute dtype
    here as ``ModelRunner.load_weights`` does on the driver (float32 for float16 weights on
    a CPU; the linear layers then pack them back to float16, see fp16_gemm)."""

    def __init__(self, *args, quantized: dict | None = None, **kwargs):
        self.quantized = quantized or {}   # module name -> (in_features, ggml types of its segments, int8 act.)
        super().__init__(*args, **kwargs)

    def load_weights(self, model, state_dict: dict[str, torch.Tensor]) -> None:
        state_dict = dict(state_dict)
        modules = dict(model.named_modules())
        for name, (in_features, qtypes, int8) in self.quantized.items():   # GGUF blocks, cut by the driver
            segments = [QuantSegment(q, state_dict.pop(f"{name}{QUANTIZED_SUFFIX}{i}")) for i, q in enumerate(qtypes)]
            modules[name].quantized = QuantizedMatrix(segments, in_features, int8)
            modules[name].weight.data = torch.empty(0)
        params = {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[0] not in self.quantized
                  or not n.endswith(".weight")}
        if params.keys() != state_dict.keys():
            raise ValueError(f"shard mismatch: missing {sorted(params.keys() - state_dict.keys())[:5]}, "
                             f"unexpected {sorted(state_dict.keys() - params.keys())[:5]}")
        for name, p in params.items():
            if state_dict[name].shape != p.shape:
                raise ValueError(f"{name}: shard of shape {tuple(state_dict[name].shape)}, expected {tuple(p.shape)}")
            p.data = state_dict[name].to(self.dtype)


# --------------------------------------------------------------------------- worker loop


def serve(conn: Connection, tp: TensorParallelGroup, device: torch.device) -> None:
    """A worker's loop: build shards, allocate KV caches, run the forwards the driver sends."""
    runners: dict[str, ModelRunner] = {}
    tables: dict[str, BlockTableDeltas] = {}
    while True:
        msg = pickle.loads(conn.recv_bytes())
        kind = msg[0]
        if kind == "execute":
            _, key, rows = msg
            runners[key].execute(tables[key].decode(rows))  # logits stay on rank 0
        elif kind in RANK_CALLS:   # the same ModelRunner method on every rank, no answer
            _, key, *args = msg
            getattr(runners[key], kind)(*args)
        elif kind == "build":
            _, key, config, dtype, max_model_len, block_size, specs, quantized = msg
            shard = {name: _recv_tensor(conn, shape, dt) for name, shape, dt in specs}
            runners[key] = _ShardRunner(config, shard, dtype, device, max_model_len, block_size, tp, quantized=quantized)
            tables[key] = BlockTableDeltas()
            del shard
            gc.collect()
            conn.send(("ready", tp.rank, key, param_bytes(runners[key].model), peak_rss_bytes()))
        elif kind == "allocate_kv_cache":
            _, key, num_blocks = msg
            runners[key].allocate_kv_cache(num_blocks)
            conn.send(("allocated", tp.rank, key))
        elif kind == "shutdown":
            return
        else:
            raise ValueError(f"unknown message {kind!r} from the driver")


# --------------------------------------------------------------------------- driver side


class TensorParallelExecutor:
    """One model sharded over a WorkerGroup, driven from rank 0 with ModelRunner's interface.

    Attributes the engine may read: ``config``, ``dtype``, ``device``, ``block_size``,
    ``model`` (rank 0's shard), ``num_blocks``, ``bytes_per_block`` (per rank: the
    KV cache of each rank holds only its kv heads), ``weight_bytes_per_rank``, ``graphs``
    (always None: steps over ranks run eagerly, not as captured CUDA graphs).
    """

    graphs = None

    def __init__(self, group: WorkerGroup, key: str, local: ModelRunner, weight_bytes: list[int], peak_rss: list[int]):
        self.group = group
        self.key = key
        self.local = local
        self.weight_bytes_per_rank = weight_bytes
        self.peak_rss_per_rank = peak_rss
        self._tables = BlockTableDeltas()

    @classmethod
    def start(cls, world_size: int, config, state_dict, dtype, device, max_model_len: int, block_size: int):
        """Start the workers and load the target on every rank."""
        group = WorkerGroup(world_size, device, serve)
        try:
            return cls.load(group, TARGET, config, state_dict, dtype, max_model_len, block_size)
        except BaseException:
            group.close()
            raise

    @classmethod
    def load(cls, group: WorkerGroup, key: str, config, state_dict, dtype, max_model_len: int, block_size: int):
        """Send each worker its shard of ``state_dict``, load rank 0's, wait for every rank."""
        for rank in range(1, group.world_size):
            shard, quantized = shard_parameters(config, state_dict, dtype, rank, group.world_size)
            specs = [(name, tuple(t.shape), t.dtype) for name, t in shard.items()]
            header = ("build", key, plain_config(config), dtype, max_model_len, block_size, specs, quantized)
            group.send(rank, pickle.dumps(header))
            for t in shard.values():
                group.send(rank, _as_bytes(t))
            del shard
        local = ModelRunner(config, state_dict, dtype, group.device, max_model_len, block_size, tp=group.tp)
        replies = group.wait_for("ready", startup_timeout_s())
        weights = [param_bytes(local.model)] + [replies[r][3] for r in range(1, group.world_size)]
        rss = [peak_rss_bytes()] + [replies[r][4] for r in range(1, group.world_size)]
        logger.info(
            "tensor parallel: %s on %d ranks (%s), weights per rank %s MiB",
            key, group.world_size, group.backend, [round(b / 2**20, 1) for b in weights],
        )
        return cls(group, key, local, weights, rss)

    def add_model(self, key: str, config, state_dict, dtype, max_model_len: int) -> "TensorParallelExecutor":
        """Another model (the draft) sharded over the same workers and process group."""
        return type(self).load(self.group, key, config, state_dict, dtype, max_model_len, self.block_size)

    # ------------------------------------------------------------- ModelRunner's interface
    @property
    def config(self):
        return self.local.config

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def model(self):
        return self.local.model

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.local.kv_caches

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.local.bytes_per_block

    @property
    def worker_pids(self) -> list[int]:
        return self.group.worker_pids

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.group.check()
        self.group.send_all(pickle.dumps(("allocate_kv_cache", self.key, num_blocks)))
        self.local.allocate_kv_cache(num_blocks)
        self.group.wait_for("allocated", startup_timeout_s())

    def execute(self, inputs: list[ForwardInput], **kwargs) -> ForwardOutput:
        """Every rank runs the same forward; rank 0's output (logits, hidden states) is returned.

        Keyword options (e.g. ``return_all_hidden``) shape rank 0's output only.
        """
        group = self.group
        group.check()
        payload = pickle.dumps(("execute", self.key, self._tables.encode(inputs)), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            group.send_all(payload)
            return self.local.execute(inputs, **kwargs)
        except WorkerError:
            raise
        except Exception as e:
            raise group.failure_from(e) from e
        except BaseException as e:  # Ctrl-C mid-step: the workers cannot be resynchronized
            group.fail(f"{type(e).__name__} in the middle of a tensor-parallel step")
            raise

    def _on_every_rank(self, method: str, *args) -> None:
        """``ModelRunner.<method>(*args)`` on every rank (one of ``RANK_CALLS``), rank 0's here."""
        assert method in RANK_CALLS
        self.group.check()
        self.group.send_all(pickle.dumps((method, self.key, *args), protocol=pickle.HIGHEST_PROTOCOL))
        getattr(self.local, method)(*args)

    def enable_lora(self) -> None:
        self._on_every_rank("enable_lora")

    def add_lora(self, adapter_id: int, modules: dict) -> None:
        """Every rank gets the adapter's full matrices and keeps its shard (``ModelRunner.add_lora``)."""
        self._on_every_rank("add_lora", adapter_id, modules)

    def remove_lora(self, adapter_id: int) -> None:
        self._on_every_rank("remove_lora", adapter_id)

    def copy_kv_slots(self, src: list[int], dst: list[int]) -> None:
        """Every rank moves the same slots of its own KV heads (see ``ModelRunner.copy_kv_slots``)."""
        self._on_every_rank("copy_kv_slots", src, dst)

    def shutdown(self) -> None:
        """Stop the workers now (also happens when the engine is garbage collected or at exit)."""
        self.group.close()


if __name__ == "__main__":
    # A worker rank of a torchrun-style launch whose rank 0 runs the engine:
    #   MASTER_ADDR=... MASTER_PORT=... WORLD_SIZE=N RANK=r LOCAL_RANK=l python -m specserve.worker.tp_executor
    run_env_worker(serve)
