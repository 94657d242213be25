"""The AMX-tile paths of the GGUF-block matmul, both arithmetics: float32 activations on bfloat16
tiles (cpu_kernels/amx_tiles.h, the default) and, with int8_activations, activations as int8
pieces on int8 tiles (amx_int8.h): three (float32's precision) or one (8 bits a sub-block). The
packing keeps the file's values bit for bit, the matmul agrees with a float64 matmul of them and of
the activations the pieces carry, and a row's bits never depend on the row count or the thread
count. Skipped on CPUs without AMX (the AVX-512 path is tested in test_quant_gemm.py)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_quant_gemm import assert_rows_bitwise_independent, gguf_values, random_blocks

from specserve.model_executor.layers import quant_gemm
from specserve.model_executor.layers.quantized import QuantizedMatrix, QuantSegment, pack_for_tiles

AMX_FORMATS = [T.Q4_K, T.Q4_1, T.Q5_0, T.Q8_0, T.Q6_K]
# arithmetic -> int8_activations: bfloat16 tiles (float32 activations), int8 tiles with 3 or 1 pieces
PIECES = {"int8x3": 3, "int8x1": 1, "bf16": False}

pytestmark = pytest.mark.skipif(not (quant_gemm.available() and quant_gemm.supports_amx(int(T.Q4_K), 16, 256)),
                                reason="no AMX tiles on this CPU (or the OS refused them)")


@pytest.fixture(params=list(PIECES))
def arithmetic(request):
    """Each test taking it runs once per tile arithmetic (``packed(..., arithmetic)``)."""
    if request.param != "bf16" and not quant_gemm.supports_amx_int8(int(T.Q4_K), 16, 256):
        pytest.skip("this build has no AMX int8 tiles")
    return request.param


def packed(qtype: T, out_features: int, in_features: int, seed: int = 0, arithmetic: str = "bf16"):
    """A random matrix packed for tiles: bfloat16 ones, or int8 ones in the arithmetic's piece count
    (every format, also where ``supports_amx_int8`` keeps another kernel: tested below)."""
    blocks = random_blocks(qtype, out_features, in_features, seed=seed)
    m = QuantizedMatrix.from_blocks(torch.from_numpy(blocks), int(qtype), in_features)
    m.int8_activations = PIECES[arithmetic]
    if arithmetic == "bf16":
        m = m.packed_for_tiles()
    else:
        tiles = quant_gemm.pack_for_amx(m.segments[0].data, int(qtype), in_features)
        m = QuantizedMatrix([QuantSegment(int(qtype), tiles, amx_packed=True, amx_int8=True)], in_features,
                            m.int8_activations)
    assert m.amx_packed and m.shape == (out_features, in_features)
    return m, gguf_values(blocks, qtype, in_features)


# Each format's code bytes in its GGUF block (Q5_0: the fifth bits too): zeroed, the block
# dequantizes to its offsets m_s (w = a_s q + m_s).
CODE_BYTES = {T.Q4_K: slice(16, 144), T.Q4_1: slice(4, 20), T.Q5_0: slice(2, 22)}


def reference(x: torch.Tensor, blocks, qtype: T, arithmetic: str) -> torch.Tensor:
    """x @ w.T [rows, out] in float64 as the tiles compute it. Three pieces (and bfloat16 tiles) carry
    float32's x, to 2^-24 of each sub-block's largest value. One int8 piece carries each sub-block as
    d * round(x / d), d = its largest |x| / 127 (amx_int8.h), times a_s q, while the offsets m_s
    multiply the sub-block's float32 sum of x itself."""
    values = gguf_values(blocks, qtype, x.shape[1]).double()
    if PIECES[arithmetic] != 1:
        return x.double() @ values.T
    sb = 16 if qtype == T.Q6_K else 32
    subs = x.reshape(x.shape[0], -1, sb)
    biggest = subs.abs().amax(-1, keepdim=True)
    d, inverse = biggest / 127.0, torch.where(biggest > 0, 127.0 / biggest, torch.zeros_like(biggest))
    carried = (d.double() * torch.round(subs * inverse).double()).reshape(x.shape)
    if qtype not in CODE_BYTES:   # Q8_0, Q6_K: no offset (Q6_K's q - 32 is exact in int32)
        return carried @ values.T
    zeroed = blocks.reshape(-1, quant_gemm.block_geometry(int(qtype))[1]).copy()
    zeroed[:, CODE_BYTES[qtype]] = 0
    offsets = gguf_values(zeroed.reshape(blocks.shape), qtype, x.shape[1]).double()
    return carried @ values.T + (x.double() - carried) @ offsets.T


def test_q8_0_runs_on_int8_tiles_whatever_the_activations(arithmetic):
    """Float32 activations of Q8_0 go to int8 tiles as three int8 pieces (its bytes need no
    unpacking there); the other formats' go to bfloat16 tiles."""
    m, _ = packed(T.Q8_0, 32, 256, arithmetic=arithmetic)
    assert [s.amx_int8 for s in m.segments] == [True]
    assert quant_gemm.float_activations_on_int8_tiles(int(T.Q8_0))
    assert not any(quant_gemm.float_activations_on_int8_tiles(int(q)) for q in AMX_FORMATS if q != T.Q8_0)
    forced = QuantizedMatrix([QuantSegment(int(T.Q8_0), m.segments[0].data, amx_packed=True)], 256)
    with pytest.raises(RuntimeError, match="kernel failed"):   # bfloat16 tiles refuse Q8_0, not misread it
        forced.matmul(torch.randn(1, 256))


@pytest.mark.parametrize("setting", [True, 1, 2, 3, 4])
def test_int8_activations_run_on_int8_tiles_in_their_piece_count(setting):
    if not quant_gemm.supports_amx_int8(int(T.Q4_K), 16, 256):
        pytest.skip("this build has no AMX int8 tiles")
    m = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(T.Q4_K, 32, 256)), int(T.Q4_K), 256)
    m.int8_activations = setting
    m = m.packed_for_tiles()
    assert [s.amx_int8 for s in m.segments] == [True]
    flags = m.kernel_qtype(m.segments[0]) & ~int(T.Q4_K)
    assert flags == quant_gemm.amx_int8_flags(int(setting))
    assert [s.amx_int8 for s in m.row_slice(16, 16).segments] == [True]   # cuts keep it
    assert [s.amx_int8 for s in m.contiguous().segments] == [True]
    plain = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(T.Q4_K, 32, 256)), int(T.Q4_K), 256)
    assert plain.packed_for_tiles().kernel_qtype(plain.packed_for_tiles().segments[0]) == \
        int(T.Q4_K) | quant_gemm.AMX_PACKED_FLAG   # float32 activations: bfloat16 tiles


def test_q6_k_with_few_pieces_keeps_the_vnni_kernel():
    """Q6_K's packing streams a third more bytes than its file at 1 row: with 1-2 pieces the VNNI
    kernel wins the decode step (quant_gemm.Q6_K_INT8_TILES_FROM_PIECES), with 3-4 the tiles do."""
    if not quant_gemm.supports_amx_int8(int(T.Q4_K), 16, 256):
        pytest.skip("this build has no AMX int8 tiles")
    m = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(T.Q6_K, 32, 256)), int(T.Q6_K), 256)
    for setting, on_tiles in ((True, False), (2, False), (3, True), (4, True)):
        m.int8_activations = setting
        assert m.packed_for_tiles().amx_packed is on_tiles, setting


@pytest.mark.parametrize("qtype", AMX_FORMATS, ids=lambda q: q.name)
def test_packing_keeps_the_files_values(qtype, arithmetic):
    m, values = packed(qtype, 48, 512, arithmetic=arithmetic)
    assert torch.equal(m.dequantize(), values)
    ids = torch.tensor([47, 0, 16, 3, 3])
    assert torch.equal(m.embedding(ids), values[ids])
    with pytest.raises(IndexError):
        m.embedding(torch.tensor([48]))


@pytest.mark.parametrize("qtype", AMX_FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 50])
def test_matmul_matches_float64_reference(qtype, rows, arithmetic):
    m, _ = packed(qtype, 64, 768, seed=rows, arithmetic=arithmetic)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 768, generator=gen)
    x[:, 5] *= 100.0   # an outlier feature, as real activations have: its sub-blocks' pieces start coarse
    bias = torch.randn(64, generator=gen)
    want = reference(x, random_blocks(qtype, 64, 768, seed=rows), qtype, arithmetic) + bias.double()
    got = m.matmul(x, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", AMX_FORMATS, ids=lambda q: q.name)
def test_no_rows(qtype, arithmetic):
    m, _ = packed(qtype, 32, 256, arithmetic=arithmetic)
    assert m.matmul(torch.empty(0, 256)).shape == (0, 32)
    # the kernel itself (the layer stack calls it from C, past Python's early return): no pass to size
    x, out, seg = torch.zeros(1, 256), torch.zeros(1, 32), m.segments[0]
    assert quant_gemm._load().specserve_quant_gemm(x.data_ptr(), 256, 0, seg.data.data_ptr(), m.kernel_qtype(seg),
                                                   32, 256, None, out.data_ptr(), 32, 2) == 0


@pytest.mark.parametrize("qtype", AMX_FORMATS, ids=lambda q: q.name)
def test_rows_bitwise_independent_of_row_count_and_threads(qtype, arithmetic):
    m, _ = packed(qtype, 80, 512, arithmetic=arithmetic)
    # a tile pass takes 5 rows (int8: 3 pieces each; two lanes up to 2 rows), 16 (1 piece; two
    # lanes up to 8 rows) or 16 (bfloat16; Q6_K 8, two A rows each)
    assert_rows_bitwise_independent(m, (1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 33, 48, 110))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda q: q.name)
def test_rows_in_chunks_keep_their_bits(qtype, arithmetic):
    """A call of many rows goes to the tiles in chunks whose activation pieces fit in a core's L2
    (amx_row_chunk: 16 rows for a 4096-wide input, 42 for the 512-wide ones above), every chunk
    through every output group: rows on either side of a chunk's end keep their bits."""
    m, _ = packed(qtype, 32, 4096, arithmetic=arithmetic)
    assert_rows_bitwise_independent(m, (15, 16, 17, 33, 40))


def test_mixed_formats_pack_segment_by_segment(arithmetic):
    """q, k in Q4_K and v in Q6_K (a Q4_K_M file's fused qkv) with a Q5_K part the tiles do not take."""
    parts = [(T.Q4_K, 32), (T.Q6_K, 16), (T.Q5_K, 16)]
    raw = [random_blocks(q, n, 512, seed=i) for i, (q, n) in enumerate(parts)]
    fused = QuantizedMatrix.cat([QuantizedMatrix.from_blocks(torch.from_numpy(b), int(q), 512)
                                 for b, (q, _) in zip(raw, parts)])
    fused.int8_activations = PIECES[arithmetic]   # Q5_K then keeps the VNNI pieces
    tiles = fused.packed_for_tiles()
    q6_k_tiles = arithmetic != "int8x1"   # 1 piece: Q6_K keeps the VNNI kernel too
    assert [s.amx_packed for s in tiles.segments] == [True, q6_k_tiles, False]
    assert [s.amx_int8 for s in tiles.segments] == [arithmetic != "bf16", arithmetic != "bf16" and q6_k_tiles, False]
    dense = torch.cat([gguf_values(b, q, 512) for b, (q, _) in zip(raw, parts)])
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    if arithmetic != "int8x1":   # (one piece: the matmul's precision is test_matmul_matches_float64_reference's)
        torch.testing.assert_close(tiles.matmul(x), x @ dense.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(tiles.row_slice(16, 32).dequantize(), dense[16:48])   # on 16-row groups
    with pytest.raises(ValueError, match="16-row groups"):
        tiles.row_slice(8, 16)
    for cut in (lambda: tiles.col_slice(0, 256), lambda: tiles.pad_rows(16), lambda: QuantizedMatrix.cat([tiles]),
                lambda: tiles.take_rows(torch.tensor([0]))):
        with pytest.raises(ValueError, match="packed for AMX"):
            cut()


def test_what_is_not_packed():
    # a row count off the 16-row groups stays as it is
    odd = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(T.Q4_K, 40, 256)), int(T.Q4_K), 256)
    assert odd.packed_for_tiles() is odd
    assert not quant_gemm.supports_amx(int(T.Q5_K), 16, 256)


def test_switched_off_by_environment(monkeypatch):
    m = QuantizedMatrix.from_blocks(torch.from_numpy(random_blocks(T.Q4_K, 32, 256)), int(T.Q4_K), 256)
    monkeypatch.setenv("SPECSERVE_CPU_AMX", "off")
    assert m.packed_for_tiles() is m


def test_requantizing_a_packed_matrix():
    m, values = packed(T.Q4_K, 32, 256)
    q41 = m.requantize(int(T.Q4_1))
    assert q41.amx_packed and q41.qtypes == [int(T.Q4_1)]
    torch.testing.assert_close(q41.dequantize(), values, rtol=0, atol=values.abs().max().item() / 8)


def test_pack_for_tiles_skips_the_embedding_lookup():
    from specserve.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from specserve.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding

    blocks = torch.from_numpy(random_blocks(T.Q4_K, 32, 256))
    model = torch.nn.ModuleDict({"embed": VocabParallelEmbedding(32, 256), "head": ParallelLMHead(32, 256),
                                 "proj": ColumnParallelLinear(256, [32], bias=False),
                                 "down": RowParallelLinear(256, 32, bias=False)})
    for name in ("embed", "head"):
        model[name].load(QuantizedMatrix.from_blocks(blocks, int(T.Q4_K), 256))
    model["proj"].load([QuantizedMatrix.from_blocks(blocks, int(T.Q4_K), 256)])
    model["down"].load(QuantizedMatrix.from_blocks(blocks, int(T.Q4_K), 256))
    former = {name: [s.data.data_ptr() for s in model[name].quantized.segments] for name in ("head", "proj", "down")}
    released = []
    assert pack_for_tiles(model, release=released.append) == 3
    # each repacked matrix's former block tensors handed over once (the loader drops their pages):
    # a slice at a time while packing, here one slice of 32 rows
    assert sorted(t.data_ptr() for ts in released for t in ts) == sorted(p for ps in former.values() for p in ps)
    assert not model["embed"].quantized.amx_packed
    assert all(model[name].quantized.amx_packed for name in ("head", "proj", "down"))
    assert not model["head"].quantized_file_order.amx_packed   # the file's order, for readers of rows
    model["head"].keep_first_tokens(20)   # rows go by 16: 32 kept, the logits trimmed to 20
    x = torch.randn(2, 256)
    torch.testing.assert_close(model["head"].compute_logits(x), x @ gguf_values(blocks.numpy(), T.Q4_K, 256)[:20].T,
                               rtol=1e-5, atol=1e-4)


def test_a_packed_head_keeps_chosen_tokens_bit_for_bit():
    """``keep_tokens`` (a draft's LM head cut to the tokens it shares with the target) takes the
    rows from the file's order and packs them again: each kept logit has the whole head's bits."""
    from specserve.model_executor.layers.vocab import ParallelLMHead

    blocks = torch.from_numpy(random_blocks(T.Q6_K, 64, 256))
    head = ParallelLMHead(64, 256)
    head.load(QuantizedMatrix.from_blocks(blocks, int(T.Q6_K), 256))
    pack_for_tiles(torch.nn.ModuleDict({"head": head}))
    assert head.quantized.amx_packed
    x = torch.randn(3, 256)
    ids = torch.tensor([40, 2, 63, 17, 5, 33, 8, 50, 11, 29, 1, 60, 22, 45, 9, 38, 3, 57])   # 18: not a group of 16
    want = head.compute_logits(x)[:, ids]
    head.keep_tokens(ids)
    assert head.quantized.amx_packed and head.quantized.shape[0] == 32   # padded to whole 16-row groups
    assert torch.equal(head.compute_logits(x), want)


def test_pack_for_amx_hands_over_each_slice_once_packed(monkeypatch):
    """A big matrix is packed AMX_PACK_ROWS rows a call, each slice released once packed (loading's
    peak memory); the bytes equal one call's."""
    blocks = torch.from_numpy(random_blocks(T.Q6_K, 64, 256))
    whole = quant_gemm.pack_for_amx(blocks, int(T.Q6_K), 256)
    monkeypatch.setattr(quant_gemm, "AMX_PACK_ROWS", 16)
    released = []
    sliced = quant_gemm.pack_for_amx(blocks, int(T.Q6_K), 256, release=released.append)
    assert torch.equal(sliced, whole)
    row_bytes = blocks.shape[1]
    assert [(t.data_ptr(), t.shape[0]) for ts in released for t in ts] == \
        [(blocks.data_ptr() + r * row_bytes, 16) for r in range(0, 64, 16)]
