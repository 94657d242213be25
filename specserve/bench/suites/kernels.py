"""CPU kernels against their references, in one run: the GGUF-block matmul format by format against
the float16 kernel on the same values, and the paged-attention kernel against the PyTorch path.

- matmul: a ``--out`` x ``--in`` weight of random blocks (float16 scales of a real weight's size),
  multiplied by ``--rows`` rows (1: a decode step, 6: a verification of 5 drafts), best of
  ``--repeat`` x 10 calls; the float16 kernel (``cpu_gemm``) multiplies the same dequantized
  values, interleaved. A small weight stays in cache, so this measures arithmetic; in a real
  forward the float16 kernel also streams 2 bytes a weight against the blocks' 0.56-1.06 (a weight
  the size of an LM head, ``--out 151936 --in 896``, streams from memory). With ``--tiles`` the
  same weight packed for AMX tiles (``QuantizedMatrix.packed_for_tiles``) is timed too,
  interleaved, on CPUs with AMX. ``--int8-activations on`` (or a piece count 2-4) times both with
  that setting (``LLM(int8_activations=...)``): the VNNI kernel against the AMX int8 tiles.
- attention: the default model's shapes (9 query heads, 3 KV heads, head_dim 64, 16-token blocks),
  decode (1 new token), verification (6) and prefill chunks (100), contexts of 60-260 tokens; the
  compiled kernel over a float16 cache (what ``dtype="auto"`` runs) against gather + SDPA over a
  float32 cache, alternated call by call, each call on the next of 30 caches (K/V from memory);
  median microseconds per layer call.
"""
from __future__ import annotations

import random
import statistics
import time

from specserve.bench.results import fmt

FORMATS = "Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K"
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208]}   # byte offsets of each block's float16 scales
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def add_arguments(p) -> None:
    p.add_argument("--parts", default="matmul,attention", help="matmul, attention or both")
    p.add_argument("--formats", default=FORMATS)
    p.add_argument("--out", type=int, default=1024, help="matmul weight rows")
    p.add_argument("--in", dest="in_features", type=int, default=512, help="matmul weight columns")
    p.add_argument("--rows", default="1,6", help="matmul activation rows, comma-separated")
    p.add_argument("--tiles", action="store_true", help="also time each weight packed for AMX tiles (CPUs with AMX)")
    p.add_argument("--int8-activations", default="off",
                   help="matmul activations: off (float32), on (int8, one piece a value) or a piece count 2-4")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--attention-repeats", type=int, default=200)


def random_blocks(name: str, out: int, in_features: int, seed: int = 0):
    """[out, row bytes] uint8 GGUF blocks: random quants, finite float16 scales of a weight's size."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from specserve.model_executor.layers import quant_gemm

    elems, nbytes = quant_gemm.block_geometry(int(GGMLQuantizationType[name]))
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out * in_features // elems, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS[name]:
        scales = (rng.standard_normal(blocks.shape[0]) * 0.02).astype(np.float16)
        blocks[:, off: off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(out, -1))


def matmul_rows(args, samples: list) -> list[list[str]]:
    import torch
    from gguf import GGMLQuantizationType

    from specserve.bench.options import int8_activations_label, parse_int8_activations
    from specserve.model_executor.layers import cpu_gemm
    from specserve.model_executor.layers.quantized import QuantizedMatrix

    int8 = parse_int8_activations(args.int8_activations)
    activations = int8_activations_label(int8)   # named in each row

    def mean_of_ten_calls(fn, x) -> float:
        t = time.perf_counter()
        for _ in range(10):
            fn(x)
        return (time.perf_counter() - t) / 10

    rows = []
    weights = args.out * args.in_features
    for name in args.formats.split(","):
        m = QuantizedMatrix.from_blocks(random_blocks(name, args.out, args.in_features),
                                        int(GGMLQuantizationType[name]), args.in_features)
        m.int8_activations = int8
        half = m.dequantize().half()
        variants = {"blocks": m}
        if args.tiles and (tiles := m.packed_for_tiles()) is not m:
            variants["AMX tiles"] = tiles
        for r in [int(n) for n in str(args.rows).split(",")]:
            x = torch.randn(r, args.in_features)
            best = {v: float("inf") for v in [*variants, "float16"]}
            for _ in range(args.repeat):
                for v, mat in variants.items():
                    best[v] = min(best[v], mean_of_ten_calls(mat.matmul, x))
                best["float16"] = min(best["float16"], mean_of_ten_calls(lambda x: cpu_gemm.fp16_weight_matmul(x, half, None), x))
            samples.append({"part": "matmul", "format": name, "rows": r, "blocks_s": best["blocks"],
                            "tiles_s": best.get("AMX tiles"), "float16_s": best["float16"]})
            for v in variants:
                tags = [t for t in (None if v == "blocks" else v, activations) if t]
                rows.append([f"matmul {name}" + (f" ({', '.join(tags)})" if tags else ""),
                             f"[{args.out}, {args.in_features}], {r} row(s)",
                             fmt(weights / best[v] / 1e9, 2) + " G weights/s",
                             fmt(weights / best["float16"] / 1e9, 2) + " G weights/s",
                             fmt(best["float16"] / best[v], 2, "x")])
    return rows


def _attention_step(batch: int, q_len: int, rng: random.Random, kernel: bool, cache_dtype):
    import torch

    from specserve.model_executor.layers import cpu_attention
    from specserve.model_executor.layers.attention import AttentionMetadata

    contexts = [rng.randint(60, 260) if q_len < 40 else q_len for _ in range(batch)]
    per_req = -(-max(contexts) // BLOCK)
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(batch)]
    usable = cpu_attention.usable
    if not kernel:   # the PyTorch path: metadata built as if the kernel were not there
        cpu_attention.usable = lambda *a: False
    try:
        return AttentionMetadata.build([q_len] * batch, contexts, tables, BLOCK, torch.device("cpu"),
                                       cache_dtype=cache_dtype)
    finally:
        cpu_attention.usable = usable


def attention_rows(args, samples: list) -> list[list[str]]:
    import torch

    from specserve.model_executor.layers import cpu_attention
    from specserve.model_executor.layers.attention import kv_cache_shape, paged_attention

    if not cpu_attention.usable("cpu", torch.float32):
        raise RuntimeError("the CPU attention kernel did not build here; nothing to compare")
    kernel_dtype = torch.float16 if cpu_attention.reads_float16_cache() else torch.float32
    variants = {"kernel": kernel_dtype, "PyTorch": torch.float32}
    shape = kv_cache_shape(400, BLOCK, KV_HEADS, HEAD_DIM)
    caches = {v: [torch.randn(shape).to(d) for _ in range(LAYERS)] for v, d in variants.items()}
    rows = []
    for batch, q_len in [(1, 1), (1, 6), (16, 1), (16, 6), (16, 100)]:
        metas = {v: _attention_step(batch, q_len, random.Random(0), v == "kernel", d) for v, d in variants.items()}
        tokens = batch * q_len
        q = torch.randn(tokens, HEADS, HEAD_DIM)
        k, v_new = torch.randn(tokens, KV_HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM)
        times = {v: [] for v in variants}
        repeats = max(5, args.attention_repeats // (1 if batch == 1 else 4 if q_len < 40 else 20))
        with torch.inference_mode():
            for i in range(repeats):
                for v in variants:
                    start = time.perf_counter()
                    paged_attention(q, k, v_new, caches[v][i % LAYERS], metas[v], HEAD_DIM ** -0.5)
                    times[v].append((time.perf_counter() - start) * 1e6)
        med = {v: statistics.median(t) for v, t in times.items()}
        samples.append({"part": "attention", "batch": batch, "new_tokens": q_len, "microseconds": times})
        rows.append(["attention", f"batch {batch}, {q_len} new token(s) each",
                     fmt(med["kernel"], 0) + f" µs ({str(kernel_dtype).split('.')[-1]} cache)",
                     fmt(med["PyTorch"], 0) + " µs (float32 cache)", fmt(med["PyTorch"] / med["kernel"], 2, "x")])
    return rows


def run(args, doc: dict) -> None:
    import torch

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    doc["params"] = {"parts": parts, "formats": args.formats, "out": args.out, "in": args.in_features,
                     "rows": args.rows, "tiles": args.tiles, "int8_activations": args.int8_activations,
                     "repeat": args.repeat, "attention_repeats": args.attention_repeats,
                     "threads": torch.get_num_threads()}
    samples, rows = [], []
    if "matmul" in parts:
        rows += matmul_rows(args, samples)
    if "attention" in parts:
        rows += attention_rows(args, samples)
    if not rows:
        raise ValueError("--parts: matmul, attention or both")
    doc["table"] = {"columns": ["kernel", "shape", "specserve", "reference", "speedup"], "rows": rows}
    doc["notes"] = ["matmul: the GGUF-block kernel (and with --tiles the weight packed for AMX tiles) against the "
                    "float16 kernel on the same values, best of the repeats (in cache where the weight fits); "
                    "attention: the compiled kernel against gather + SDPA (median per layer call)."]
    doc["samples"] = samples
