"""A decoder layer's row-wise work in two compiled calls, for GGUF-quantized weights on CPUs.

``cpu_kernels/quant_layer.c`` runs, per layer and step, (1) the input norm, the
fused q/k/v matmul and the rotary, and (2) the output projection, the residual
add, the post-attention norm, gate/up, silu * up, down and the second residual
add, each half in one OpenMP parallel region. Attention between them stays
``attention.paged_attention`` (the compiled kernel or SDPA, whatever serves the
step). The PyTorch path does the same work in ~30 calls per layer, each paying
dispatch and, for the matmuls, an OpenMP fork and join; at batch 1 on the
default model those took more than half of a decode step (docs/benchmarks.md,
"Quantized weights").

Used by ``LlamaForCausalLM`` when every layer's four matrices are ``QuantizedMatrix`` at
tensor-parallel size 1 on a CPU (``QuantizedLayerKernel.for_layer``); anything
else runs the PyTorch path. ``SPECSERVE_CPU_QUANT_LAYER=off`` turns it off.
"""
from __future__ import annotations

import ctypes

import torch

from specserve.model_executor.layers.kernel_build import LazyLibrary
from specserve.model_executor.layers.quant_gemm import COMPILE_FLAGS, check_status
from specserve.model_executor.layers.quantized import QuantizedMatrix

MAX_SEGMENTS = 4


class _QMatrix(ctypes.Structure):
    _fields_ = [("num_segments", ctypes.c_int32), ("qtype", ctypes.c_int32 * MAX_SEGMENTS),
                ("rows", ctypes.c_int64 * MAX_SEGMENTS), ("data", ctypes.c_void_p * MAX_SEGMENTS)]


class _QLayer(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", _QMatrix), ("o", _QMatrix), ("gate_up", _QMatrix), ("down", _QMatrix)]


def _setup(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    sizes = (ctypes.c_int64 * 2)()
    lib.specserve_qlayer_struct_sizes(sizes)
    if (sizes[0], sizes[1]) != (ctypes.sizeof(_QMatrix), ctypes.sizeof(_QLayer)):
        raise RuntimeError(f"quant_layer.c's structs ({sizes[0]}, {sizes[1]} bytes) differ from their ctypes mirror")
    lib.specserve_qlayer_attn_in.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, c_int]
    lib.specserve_qlayer_mlp.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, c_int]
    lib.specserve_qlayer_attn_in.restype = lib.specserve_qlayer_mlp.restype = c_int


LIBRARY = LazyLibrary("quant_layer.c", COMPILE_FLAGS, _setup, "SPECSERVE_CPU_QUANT_LAYER", "off", "the PyTorch path")


def _qmatrix(m: QuantizedMatrix) -> _QMatrix:
    s = _QMatrix()
    s.num_segments = len(m.segments)
    for i, seg in enumerate(m.segments):
        s.qtype[i], s.rows[i], s.data[i] = m.kernel_qtype(seg), seg.data.shape[0], seg.data.data_ptr()
    return s


def _matrices(layer) -> list[QuantizedMatrix | None]:
    """The layer's q/k/v, output, gate/up and down matrices, in quant_layer.c's order."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj.quantized, attn.o_proj.quantized, mlp.gate_up_proj.quantized, mlp.down_proj.quantized]


class QuantizedLayerKernel:
    """One decoder layer's two compiled halves (module docstring); holds its tensors' pointers."""

    def __init__(self, layer, eps: float):
        attn, mlp = layer.self_attn, layer.mlp
        self._lib = LIBRARY.get()
        self._keep = [layer.input_layernorm.weight.data.float().contiguous(),
                      layer.post_attention_layernorm.weight.data.float().contiguous()]
        bias = attn.qkv_proj.bias
        if bias is not None:
            self._keep.append(bias.data.float().contiguous())
        s = self._struct = _QLayer()
        s.hidden, s.num_heads, s.num_kv_heads = layer.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads
        s.head_dim, s.intermediate = attn.head_dim, mlp.down_proj.quantized.in_features
        s.eps = eps
        s.input_norm, s.post_norm = self._keep[0].data_ptr(), self._keep[1].data_ptr()
        s.qkv_bias = self._keep[2].data_ptr() if bias is not None else None
        self._mats = _matrices(layer)   # kept alive with the pointers into them
        s.qkv, s.o, s.gate_up, s.down = (_qmatrix(m) for m in self._mats)
        self._ref = ctypes.byref(s)
        self.qkv_width = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim

    @staticmethod
    def for_layer(layer, eps: float, tp_world_size: int) -> "QuantizedLayerKernel | None":
        """The kernel for ``layer`` where it applies (module docstring), else None."""
        if tp_world_size != 1 or any(m is None or len(m.segments) > MAX_SEGMENTS for m in _matrices(layer)):
            return None
        if LIBRARY.get() is None:
            return None
        return QuantizedLayerKernel(layer, eps)

    def attn_in(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                scratch: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> qkv [T, (Hq + 2 Hk) hd], q and k rotated; scratch [T, hidden]."""
        qkv = torch.empty(x.shape[0], self.qkv_width, dtype=torch.float32)
        check_status(self._lib.specserve_qlayer_attn_in(self._ref, x.data_ptr(), x.shape[0], positions.data_ptr(),
                                                  cos.data_ptr(), sin.data_ptr(), scratch.data_ptr(),
                                                  qkv.data_ptr(), torch.get_num_threads()), "a layer's q/k/v")
        return qkv

    def mlp(self, x: torch.Tensor, attn_out: torch.Tensor, scratch: torch.Tensor, gate_up: torch.Tensor) -> None:
        """x [T, hidden] += the layer's output projection and MLP (in place); attn_out [T, Hq hd]."""
        check_status(self._lib.specserve_qlayer_mlp(self._ref, x.data_ptr(), x.shape[0], attn_out.data_ptr(),
                                              attn_out.stride(0), scratch.data_ptr(), gate_up.data_ptr(),
                                              torch.get_num_threads()), "a layer's MLP")
