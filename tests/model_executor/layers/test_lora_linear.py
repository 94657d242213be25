"""LoRA in the linear layers (layers/lora.py): each row gains its own adapter's B (A x), rows of no
adapter nothing; fused layers give each part its own adapter (block-diagonal B); a step without
adapters is the base layer exactly."""
from __future__ import annotations

import torch

from specserve.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from specserve.model_executor.layers.lora import LoraRows, LoraWeights


def _pair(out_f: int, in_f: int, r: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, in_f, generator=g), torch.randn(out_f, r, generator=g)


def test_rows_group_by_adapter():
    rows = LoraRows()
    rows.set([2, 2, 2], torch.device("cpu"))
    assert rows.groups == [(2, None)] and rows.active
    rows.set([0, 1, 3, 1], torch.device("cpu"))
    assert [(a, r.tolist()) for a, r in rows.groups] == [(1, [1, 3]), (3, [2])]
    rows.clear()
    assert not rows.active


def test_fused_column_layer_gives_each_row_and_part_its_adapter():
    in_f, sizes = 8, [6, 4, 4]          # q, k, v
    layer = ColumnParallelLinear(in_f, sizes, bias=True)
    w = [torch.randn(n, in_f) for n in sizes]
    bias = [torch.randn(n) for n in sizes]
    layer.load(w, bias)
    rows = LoraRows()
    layer.lora = LoraWeights(rows)
    q1, v1 = _pair(6, in_f, 2, 1), _pair(4, in_f, 3, 2)           # adapter 1: q and v
    k2 = _pair(4, in_f, 4, 3)                                     # adapter 2: k only
    layer.set_lora(1, [q1, None, v1], torch.float32, "cpu")
    layer.set_lora(2, [None, k2, None], torch.float32, "cpu")
    x = torch.randn(5, in_f)
    base = x @ torch.cat(w).T + torch.cat(bias)
    assert torch.equal(layer(x), base)                            # no rows set: the base layer exactly
    rows.set([1, 0, 2, 1, 0], torch.device("cpu"))
    y = layer(x)
    want = base.clone()
    for i in (0, 3):
        want[i, :6] += (q1[1] @ (q1[0] @ x[i]))
        want[i, 10:] += (v1[1] @ (v1[0] @ x[i]))
    want[2, 6:10] += k2[1] @ (k2[0] @ x[2])
    torch.testing.assert_close(y, want)


def test_row_parallel_layer_and_a_layer_the_adapter_skips():
    layer = RowParallelLinear(8, 5, bias=False)
    w = torch.randn(5, 8)
    layer.load(w)
    rows = LoraRows()
    layer.lora = LoraWeights(rows)
    a, b = _pair(5, 8, 2, 4)
    layer.set_lora(1, (a, b), torch.float32, "cpu")
    layer.set_lora(2, None, torch.float32, "cpu")                 # adapter 2 leaves this layer alone
    x = torch.randn(3, 8)
    rows.set([1, 2, 1], torch.device("cpu"))
    want = x @ w.T
    want[[0, 2]] += (x[[0, 2]] @ a.T) @ b.T
    torch.testing.assert_close(layer(x), want)
    rows.set([1, 1, 1], torch.device("cpu"))                      # one adapter for every row: no gather
    torch.testing.assert_close(layer(x), x @ w.T + (x @ a.T) @ b.T)
