"""Paged attention on a GPU, three ways, at decode and verification shapes: which one a step
should use.

A layer's attention in a step writes the step's new K/V into the paged cache, then attends each
request's new rows (1 for decode, k + 1 for a verification) to its whole context, whose K/V
lie in 16-token blocks scattered over the cache (``ModelRunner``'s block tables). Measured:
  - ``triton``: specserve's kernel (``layers/triton_attention.py``), which reads the blocks
    through the block table (the engine's default on CUDA);
  - ``sdpa``: the gather path (``layers/attention.py``): the context's blocks copied into one
    buffer, then PyTorch's ``scaled_dot_product_attention`` with a mask (the engine's
    ``SPECSERVE_GPU_ATTENTION=sdpa``);
  - ``flex``: PyTorch's ``flex_attention`` (compiled on CUDA) over the whole cache as one
    sequence per request, with a block mask that keeps each request's own blocks: no gather,
    the sparsity is the block table's. Its mask is built once per step for every layer; its
    build time is reported apart (``flex mask ms``).
Each kernel's output is checked against ``sdpa``'s (the largest difference is reported, and
the suite fails if it is past the dtype's tolerance), then timed: per round, every kernel at
every (batch, rows) back to back, a warm-up call and ``--calls`` timed calls (synchronised
on CUDA); reported: the median ms per call.

Random K/V and queries of a published shape's attention (``bench/random_weights.py``: heads,
KV heads, head size), ``--context`` cached tokens per request and block tables that are a
random permutation of the cache's blocks, as after a while of serving.
"""
from __future__ import annotations

import statistics
import time

from specserve.bench.results import fmt

KERNELS = ("triton", "sdpa", "flex")
BLOCK_SIZE = 16


def add_arguments(p) -> None:
    p.add_argument("--shape", default="llama-3.1-8b",
                   help="whose attention: a shape of bench/random_weights.py (llama-3.1-8b, llama-3.2-1b, "
                        "qwen2.5-1.5b, smollm2-135m, tiny)")
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated, of: " + ", ".join(KERNELS))
    p.add_argument("--batches", default="1,8,32", help="comma-separated requests per step")
    p.add_argument("--rows", default="1,5", help="comma-separated new rows per request (1: decode; k + 1: verify)")
    p.add_argument("--context", type=int, default=1024, help="tokens cached per request before the new rows")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=10, help="timed calls per kernel, shape and round")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


class Step:
    """One step's random queries, new K/V and cache, with every kernel's prepared inputs."""

    def __init__(self, config, batch: int, rows: int, context: int, dtype, device, kernels: list[str], seed: int = 0):
        import torch

        from specserve.model_executor.layers.attention import AttentionMetadata

        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = head_dim ** -0.5
        self.batch, self.rows = batch, rows
        blocks_per_request = -(-(context + rows) // BLOCK_SIZE)
        num_blocks = batch * blocks_per_request + 8          # a few more than the step needs
        gen = torch.Generator(device=device).manual_seed(seed)
        self.kv_cache = torch.randn(2, self.num_kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=gen,
                                    device=device).to(dtype)   # [2, Hk, num_blocks, block_size, hd]
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.block_tables = [order[b * blocks_per_request:(b + 1) * blocks_per_request] for b in range(batch)]
        tokens = batch * rows
        self.q = torch.randn(tokens, self.num_heads, head_dim, generator=gen, device=device).to(dtype)  # [T, Hq, hd]
        self.k = torch.randn(tokens, self.num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        self.v = torch.randn(tokens, self.num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        self.query_lens = [rows] * batch
        self.context_lens = [context + rows] * batch
        self.meta = AttentionMetadata.build(self.query_lens, self.context_lens, self.block_tables, BLOCK_SIZE,
                                            torch.device(device), dtype)
        self.flex_mask_ms = self.flex_mask = self.flex_error = None
        if "flex" in kernels:
            start = time.perf_counter()
            try:
                self.flex_mask = flex_block_mask(self.block_tables, self.context_lens, rows, num_blocks, device)
            except Exception as e:   # noqa: BLE001 - reported as flex's failure by run("flex")
                self.flex_error = e
            synchronize(device)
            self.flex_mask_ms = (time.perf_counter() - start) * 1e3

    def run(self, kernel: str):
        """The layer's attention by ``kernel``: write the new K/V, attend -> [T, Hq, hd]."""
        from dataclasses import replace

        from specserve.model_executor.layers.attention import paged_attention

        if kernel == "triton":
            if self.meta.triton is None:
                raise RuntimeError("the Triton kernel does not serve this device (CUDA and Triton needed)")
            return paged_attention(self.q, self.k, self.v, self.kv_cache, replace(self.meta, kernel=None), self.scale)
        if kernel == "sdpa":
            return paged_attention(self.q, self.k, self.v, self.kv_cache, replace(self.meta, kernel=None, triton=None),
                                   self.scale)
        if kernel == "flex":
            if self.flex_error is not None:
                raise self.flex_error
            return self._flex()
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNELS)}")

    def _flex(self):
        hk, hd = self.num_kv_heads, self.kv_cache.shape[-1]
        slots = self.kv_cache.view(2, hk, -1, hd)                                  # [2, Hk, S, hd]
        slots[0].index_copy_(1, self.meta.slot_mapping, self.k.transpose(0, 1))
        slots[1].index_copy_(1, self.meta.slot_mapping, self.v.transpose(0, 1))
        # Every request reads the whole cache as its sequence (a key batch of 1, broadcast over
        # the requests); the block mask keeps each request's own blocks.
        keys, values = slots[0].unsqueeze(0), slots[1].unsqueeze(0)                 # [1, Hk, S, hd]
        q = self.q.view(self.batch, self.rows, self.num_heads, hd).transpose(1, 2)  # [B, Hq, rows, hd]
        out = _flex_attention(q.device)(q, keys, values, block_mask=self.flex_mask, scale=self.scale,
                                        enable_gqa=self.num_heads != hk)            # [B, Hq, rows, hd]
        return out.transpose(1, 2).reshape(-1, self.num_heads, hd)


def flex_block_mask(block_tables: list[list[int]], context_lens: list[int], rows: int, num_blocks: int, device):
    """flex_attention's BlockMask for requests that read the whole cache (``num_blocks`` x 16
    slots) as their key sequence: request b's row i (position context_lens[b] - rows + i) sees
    the slots of its own blocks at positions up to its own, 16-slot blocks being the mask's
    key blocks (so the kernel visits the request's blocks only)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_slots = len(block_tables), num_blocks * BLOCK_SIZE
    owner = torch.full((batch, num_slots), -1, dtype=torch.int32)   # [B, S]: the slot's position for request b, or -1
    for b, table in enumerate(block_tables):
        first = torch.tensor(table, dtype=torch.int64)[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)  # [blocks, 16]
        positions = torch.arange(first.numel(), dtype=torch.int32)
        keep = positions < context_lens[b]
        owner[b, first.flatten()[keep]] = positions[keep]
    owner = owner.to(device)
    first_row = torch.tensor([c - rows for c in context_lens], dtype=torch.int32, device=device)   # [B]

    def mask_mod(b, h, q_idx, kv_idx):
        position = owner[b, kv_idx]
        return (position >= 0) & (position <= first_row[b] + q_idx)

    return create_block_mask(mask_mod, batch, None, rows, num_slots, device=device,
                             BLOCK_SIZE=(128, BLOCK_SIZE), _compile=torch.device(device).type == "cuda")


def _flex_attention(device):
    """flex_attention compiled on CUDA (its fused kernel), eager elsewhere (its reference)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        # 16-slot key blocks: the kernel's key tile must divide them.
        _COMPILED_FLEX = torch.compile(
            lambda *a, **kw: flex_attention(*a, kernel_options={"BLOCK_N": BLOCK_SIZE}, **kw), dynamic=False)
    return _COMPILED_FLEX


_COMPILED_FLEX = None


def synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, calls: int, device) -> float:
    """Mean ms of ``calls`` back-to-back calls after one warm-up, synchronised before and after."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / calls


def run(args, doc: dict) -> None:
    import torch

    from specserve.bench.random_weights import shape_config
    from specserve.engine.start_up import resolve_device
    from specserve.model_executor.loader import resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown or not kernels:
        raise ValueError(f"--kernels: unknown {unknown}; known: {', '.join(KERNELS)}")
    batches = sorted({int(b) for b in args.batches.split(",")})
    rows_list = sorted({int(r) for r in args.rows.split(",")})
    if batches[0] < 1 or rows_list[0] < 1 or args.context < 0:
        raise ValueError("--batches and --rows need counts >= 1, --context >= 0")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    config = shape_config(args.shape)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    steps, failed, worst = {}, {}, {}
    for batch in batches:
        for rows in rows_list:
            step = steps[batch, rows] = Step(config, batch, rows, args.context, dtype, device, kernels)
            reference = step.run("sdpa").float()
            for kernel in kernels:
                try:
                    diff = (step.run(kernel).float() - reference).abs().max().item()
                except Exception as e:   # noqa: BLE001 - a kernel that cannot run here is reported, not fatal
                    failed[kernel] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    continue
                worst[kernel] = max(worst.get(kernel, 0.0), diff)
                if diff > tolerance:
                    raise AssertionError(f"{kernel} differs from sdpa by {diff:.2e} at batch {batch}, rows {rows}")
    running = [k for k in kernels if k not in failed]
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for (batch, rows), step in steps.items():
            for kernel in running:
                times.setdefault((kernel, batch, rows), []).append(time_calls(lambda: step.run(kernel), args.calls,
                                                                              device))
    medians = {key: statistics.median(v) for key, v in times.items()}
    table = []
    for (batch, rows), step in steps.items():
        base = medians.get(("sdpa", batch, rows))
        for kernel in kernels:
            if kernel in failed:
                table.append([str(batch), str(rows), kernel, "failed", "—", "—"])
                continue
            ms = medians[kernel, batch, rows]
            mask = fmt(step.flex_mask_ms, 2) if kernel == "flex" else "—"
            table.append([str(batch), str(rows), kernel, fmt(ms, 3), f"{base / ms:.2f}x" if base else "—", mask])
    doc["params"] = {"shape": args.shape, "kernels": kernels, "batches": batches, "rows": rows_list,
                     "context": args.context, "rounds": args.rounds, "calls": args.calls, "dtype": str(dtype),
                     "device": str(device), "threads": torch.get_num_threads(), "block_size": BLOCK_SIZE,
                     "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads}
    doc["table"] = {"columns": ["batch", "rows", "kernel", "ms per call", "speed vs sdpa", "flex mask ms"],
                    "rows": table}
    doc["max_abs_diff_vs_sdpa"] = worst
    doc["failed"] = failed
    doc["notes"] = [f"One layer's attention of the {args.shape} shape: write the step's K/V, attend every request's "
                    f"new rows to {args.context} cached tokens in 16-token blocks (a random permutation of the "
                    "cache); median over rounds of the mean of the timed calls.",
                    "flex mask ms: building flex_attention's block mask, once per step for all layers.",
                    "Largest |kernel - sdpa| over the shapes: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
                    + (". Failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()) if failed else "")]
    doc["samples"] = [{"kernel": k, "batch": b, "rows": r, "ms": v} for (k, b, r), v in times.items()]
