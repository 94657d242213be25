"""A decoder layer's row-wise work in two compiled calls, for GGUF-quantized weights on CPUs.

``cpu_kernels/quant_layer.c`` runs, per layer and step, (1) the input norm, the
fused q/k/v matmul and the rotary, and (2) the output projection, the residual
add, the post-attention norm, gate/up, silu * up, down and the second residual
add, each half in one OpenMP parallel region; each row's matmuls with its LoRA adapter, if
any (``QuantizedLayerKernel.use_adapters``: rows of several adapters, and of none, in one call). Attention between them stays
``attention.paged_attention`` (the compiled kernel or SDPA, whatever serves the
step). The PyTorch path does the same work in ~30 calls per layer, each paying
dispatch and, for the matmuls, an OpenMP fork and join; at batch 1 on the
default model those took more than half of a decode step (docs/benchmarks.md,
"Quantized weights").

Used by ``DecoderForCausalLM`` (every family: the layer's norms, q/k norms, activation,
residual scale, rotary table and attention options come from its ``DecoderSpec``) when every
layer's four matrices are ``QuantizedMatrix`` at
tensor-parallel size 1 on a CPU (``QuantizedLayerKernel.for_layer``); anything
else runs the PyTorch path. ``SPECSERVE_CPU_QUANT_LAYER=off`` turns it off.

``QuantizedLayerStack``: when the compiled attention kernel serves every request of a
step (every step on a CPU in float32: ``AttentionMetadata.kernel``), all layers
run in ONE call (``specserve_qmodel_layers``), which calls the same two halves and the
same attention kernel with the same arguments (each layer's ``sliding_window`` and
``logit_softcap``, read from its attention module, included), so the bits are those of the per-layer
path; what it saves is the Python and ctypes work of ~3 calls per layer.
"""
from __future__ import annotations

import ctypes

import torch

from specserve.model_executor.layers import cpu_attention
from specserve.model_executor.layers.kernel_build import LazyLibrary
from specserve.model_executor.layers.quant_gemm import COMPILE_FLAGS, check_status
from specserve.model_executor.layers.quantized import QuantizedMatrix

MAX_SEGMENTS = 4


class _QMatrix(ctypes.Structure):
    _fields_ = [("num_segments", ctypes.c_int32), ("qtype", ctypes.c_int32 * MAX_SEGMENTS),
                ("rows", ctypes.c_int64 * MAX_SEGMENTS), ("data", ctypes.c_void_p * MAX_SEGMENTS)]


class _QLora(ctypes.Structure):
    """quant_layer.c's qlora: a LoRA adapter on one matrix (a [rank, in], bt = B.T [rank, out])."""
    _fields_ = [("rank", ctypes.c_int64), ("a", ctypes.c_void_p), ("bt", ctypes.c_void_p)]


class _QLayer(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float),
                ("sliding_window", ctypes.c_int32), ("attn_softcap", ctypes.c_float),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", _QMatrix), ("o", _QMatrix), ("gate_up", _QMatrix), ("down", _QMatrix),
                ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("qk_norm", ctypes.c_int32), ("activation", ctypes.c_int32), ("residual_scale", ctypes.c_float),
                ("cos_table", ctypes.c_void_p), ("sin_table", ctypes.c_void_p), ("rotary_dim", ctypes.c_int64),
                ("lora_row", ctypes.c_void_p), ("lora_qkv", ctypes.c_void_p), ("lora_o", ctypes.c_void_p),
                ("lora_gate_up", ctypes.c_void_p), ("lora_down", ctypes.c_void_p), ("lora_max_rank", ctypes.c_int64)]

_QK_NORM_KINDS = {None: 0, "head": 1, "all": 2}   # quant_layer.c's QK_NORM_*
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}        # quant_layer.c's ACT_*


class _QAttention(ctypes.Structure):
    """quant_layer.c's qattention: what every layer's attention call of one step shares."""
    _fields_ = [("attend", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int64),
                ("query_start", ctypes.c_void_p), ("query_lens", ctypes.c_void_p), ("context_lens", ctypes.c_void_p),
                ("tree_masks", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p), ("num_blocks", ctypes.c_int64),
                ("num_reqs", ctypes.c_int32), ("block_size", ctypes.c_int32), ("cache_half", ctypes.c_int32),
                ("scale", ctypes.c_float)]


def _setup(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    sizes = (ctypes.c_int64 * 3)()
    lib.specserve_qlayer_struct_sizes(sizes)
    if tuple(sizes) != (ctypes.sizeof(_QMatrix), ctypes.sizeof(_QLayer), ctypes.sizeof(_QLora)):
        raise RuntimeError(f"quant_layer.c's structs ({tuple(sizes)} bytes) differ from their ctypes mirror")
    lib.specserve_qlayer_attn_in.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, c_int]
    lib.specserve_qlayer_mlp.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, c_int]
    lib.specserve_qlayer_attn_in.restype = lib.specserve_qlayer_mlp.restype = c_int
    lib.specserve_qattention_struct_size.restype = c_int
    lib.specserve_qmodel_layers.argtypes = [ptr, c_int, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, c_int]
    lib.specserve_qmodel_layers.restype = c_int


LIBRARY = LazyLibrary("quant_layer.c", COMPILE_FLAGS, _setup, "SPECSERVE_CPU_QUANT_LAYER", "off", "the PyTorch path")


def _qmatrix(m: QuantizedMatrix) -> _QMatrix:
    s = _QMatrix()
    s.num_segments = len(m.segments)
    for i, seg in enumerate(m.segments):
        s.qtype[i], s.rows[i], s.data[i] = m.kernel_qtype(seg), seg.rows, seg.data.data_ptr()
    return s


def _matrices(layer) -> list[QuantizedMatrix | None]:
    """The layer's q/k/v, output, gate/up and down matrices, in quant_layer.c's order."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj.quantized, attn.o_proj.quantized, mlp.gate_up_proj.quantized, mlp.down_proj.quantized]


class QuantizedLayerKernel:
    """One decoder layer's two compiled halves (module docstring); holds its tensors' pointers."""

    def __init__(self, layer, eps: float, rotary):
        """``layer``: a ``DecoderLayer``; ``rotary``: its ``RotaryEmbedding`` (None: no rotary)."""
        attn, mlp = layer.self_attn, layer.mlp
        self._lib = LIBRARY.get()
        self._keep: list[torch.Tensor] = []   # every tensor the struct points into, kept alive

        def pointer(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            self._keep.append(t.float().contiguous())
            return self._keep[-1].data_ptr()

        def norm_weight(norm) -> int | None:
            return None if norm is None else pointer(norm.kernel_weight())

        s = self._struct = _QLayer()
        s.hidden, s.num_heads, s.num_kv_heads = mlp.down_proj.quantized.shape[0], attn.num_heads, attn.num_kv_heads
        s.head_dim, s.intermediate = attn.head_dim, mlp.down_proj.quantized.in_features
        s.eps = eps
        # The layer's attention options, as paged_attention takes them (None: off, 0 here).
        window, softcap = getattr(attn, "sliding_window", None), getattr(attn, "logit_softcap", None)
        s.sliding_window = min(window, 2**31 - 1) if window is not None else 0
        s.attn_softcap = softcap if softcap is not None else 0.0
        s.input_norm, s.post_norm = norm_weight(layer.attn_norm), norm_weight(layer.mlp_norm)
        s.attn_out_norm, s.mlp_out_norm = norm_weight(layer.attn_out_norm), norm_weight(layer.mlp_out_norm)
        s.q_norm, s.k_norm = norm_weight(attn.q_norm), norm_weight(attn.k_norm)
        s.qk_norm, s.activation = _QK_NORM_KINDS[attn.qk_norm], _ACTIVATIONS[mlp.activation]
        s.residual_scale = layer.residual_scale
        bias = attn.qkv_proj.bias
        s.qkv_bias = pointer(bias.data) if bias is not None else None
        if rotary is not None:
            s.cos_table, s.sin_table, s.rotary_dim = pointer(rotary.cos), pointer(rotary.sin), rotary.rotary_dim
            self.max_positions = rotary.cos.shape[0]
        else:
            s.cos_table = s.sin_table = None
            s.rotary_dim, self.max_positions = 0, None
        self._mats = _matrices(layer)   # kept alive with the pointers into them
        s.qkv, s.o, s.gate_up, s.down = (_qmatrix(m) for m in self._mats)
        self._ref = ctypes.byref(s)
        self.qkv_width = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
        self._linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]   # quant_layer.c's order
        self._lora_key: tuple[int, ...] | None = None     # the adapters the struct's tables hold now
        self._lora_tables: dict[tuple[int, ...], tuple] = {}  # adapters -> (4 ctypes tables, largest rank)

    def use_adapters(self, adapters: tuple[int, ...], rows: torch.Tensor | None) -> None:
        """The step's LoRA adapters for the following calls: ``adapters`` (ids) are entries 1.. of
        each matrix's table (entry 0: none), ``rows`` [T] int32 each row's entry (None: no LoRA rows;
        kept alive by the caller until the calls are done)."""
        s = self._struct
        if rows is None:
            s.lora_row = None
            return
        if adapters != self._lora_key:
            if adapters not in self._lora_tables:
                if len(self._lora_tables) >= 64:
                    self._lora_tables.clear()
                self._lora_tables[adapters] = self._tables(adapters)
            tables, max_rank = self._lora_tables[adapters]
            s.lora_qkv, s.lora_o, s.lora_gate_up, s.lora_down = (ctypes.addressof(t) for t in tables)
            s.lora_max_rank = max_rank
            self._lora_key = adapters
        s.lora_row = rows.data_ptr()

    def forget_adapters(self) -> None:
        """Drop every table (an adapter was removed: its matrices may go)."""
        self._struct.lora_row = None
        self._lora_key = None
        self._lora_tables.clear()

    def _tables(self, adapters: tuple[int, ...]) -> tuple[list, int]:
        """Per matrix, a ctypes array of qlora: entry 0 none, entry j adapter ``adapters[j - 1]`` (its
        ``LoraWeights``' kernel form; rank 0 where it leaves the matrix alone)."""
        tables, max_rank = [], 0
        for linear in self._linears:
            table = (_QLora * (len(adapters) + 1))()
            for j, adapter_id in enumerate(adapters, 1):
                pair = linear.lora.kernel_pair(adapter_id) if linear.lora is not None else None
                if pair is not None:
                    table[j].rank, table[j].a, table[j].bt = pair[0].shape[0], pair[0].data_ptr(), pair[1].data_ptr()
                    max_rank = max(max_rank, pair[0].shape[0])
            tables.append(table)
        return tables, max_rank

    @staticmethod
    def for_layer(layer, eps: float, tp_world_size: int, rotary) -> "QuantizedLayerKernel | None":
        """The kernel for ``layer`` where it applies (module docstring), else None."""
        if tp_world_size != 1 or any(m is None or len(m.segments) > MAX_SEGMENTS for m in _matrices(layer)):
            return None
        if LIBRARY.get() is None:
            return None
        return QuantizedLayerKernel(layer, eps, rotary)

    def attn_in(self, x: torch.Tensor, positions: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> qkv [T, (Hq + 2 Hk) hd], q and k normed and rotated; scratch [T, hidden]."""
        qkv = torch.empty(x.shape[0], self.qkv_width, dtype=torch.float32)
        check_status(self._lib.specserve_qlayer_attn_in(self._ref, x.data_ptr(), x.shape[0], positions.data_ptr(),
                                                        scratch.data_ptr(), qkv.data_ptr(), torch.get_num_threads()),
                     "a layer's q/k/v")
        return qkv

    def mlp(self, x: torch.Tensor, attn_out: torch.Tensor, scratch: torch.Tensor, gate_up: torch.Tensor) -> None:
        """x [T, hidden] += the layer's output projection and MLP (in place); attn_out [T, Hq hd]."""
        check_status(self._lib.specserve_qlayer_mlp(self._ref, x.data_ptr(), x.shape[0], attn_out.data_ptr(),
                                              attn_out.stride(0), scratch.data_ptr(), gate_up.data_ptr(),
                                              torch.get_num_threads()), "a layer's MLP")


class QuantizedLayerStack:
    """Every layer's kernel in one call per step, attention included (module docstring)."""

    def __init__(self, kernels: list[QuantizedLayerKernel]):
        self._lib = LIBRARY.get()
        self.kernels = kernels
        self._layers = (ctypes.c_void_p * len(kernels))(*(ctypes.addressof(k._struct) for k in kernels))
        self._caches: tuple | None = None     # (the caches' data pointers, their K and V pointer arrays)
        first = kernels[0]._struct
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        # the attention kernel's address, which the one call invokes per layer
        self._attend = ctypes.cast(cpu_attention.LIBRARY.get().specserve_paged_attention, ctypes.c_void_p).value

    @staticmethod
    def build(kernels: list[QuantizedLayerKernel]) -> "QuantizedLayerStack | None":
        """None where the one-call path cannot run: no attention kernel, or a build without F16C."""
        lib = LIBRARY.get()
        if lib is None or cpu_attention.LIBRARY.get() is None:
            return None
        if lib.specserve_qattention_struct_size() != ctypes.sizeof(_QAttention):
            return None
        return QuantizedLayerStack(kernels)

    def _cache_pointers(self, kv_caches: list[torch.Tensor]):
        key = tuple(c.data_ptr() for c in kv_caches)
        if self._caches is None or self._caches[0] != key:
            ks = (ctypes.c_void_p * len(kv_caches))(*(c[0].data_ptr() for c in kv_caches))
            vs = (ctypes.c_void_p * len(kv_caches))(*(c[1].data_ptr() for c in kv_caches))
            self._caches = (key, ks, vs)
        return self._caches[1], self._caches[2]

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta, scale: float,
            scratch: torch.Tensor, gate_up: torch.Tensor) -> None:
        """x [T, hidden] float32 through every layer, in place; ``meta.kernel`` must cover the step
        (each kv cache [2, Hk, num_blocks, block_size, hd], contiguous, float32 or float16)."""
        kn, cache = meta.kernel, kv_caches[0]
        assert kn is not None and all(c.is_contiguous() for c in kv_caches)
        a = _QAttention()
        a.attend = self._attend
        a.block_tables, a.max_blocks = kn.block_tables.data_ptr(), kn.block_tables.shape[1]
        a.query_start, a.query_lens = kn.query_start.data_ptr(), kn.query_lens.data_ptr()
        a.context_lens, a.slot_mapping = kn.context_lens.data_ptr(), meta.slot_mapping.data_ptr()
        a.tree_masks = kn.tree_masks.data_ptr() if kn.tree_masks is not None else None
        a.num_blocks, a.block_size = cache.shape[2], cache.shape[3]
        a.num_reqs, a.cache_half, a.scale = kn.block_tables.shape[0], int(cache.dtype == torch.float16), scale
        tokens = x.shape[0]
        qkv = torch.empty(tokens, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim)   # [T, (Hq + 2 Hk) hd]
        attn = torch.empty(tokens, self.num_heads * self.head_dim)                            # [T, Hq hd]
        ks, vs = self._cache_pointers(kv_caches)
        status = self._lib.specserve_qmodel_layers(
            self._layers, len(self.kernels), ks, vs, ctypes.byref(a), x.data_ptr(), tokens, positions.data_ptr(),
            scratch.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), torch.get_num_threads())
        if status == 1002:
            raise RuntimeError("this build of the paged attention kernel cannot read a float16 cache (no F16C)")
        if status > 1000:
            raise MemoryError("paged attention kernel: scratch allocation failed")
        check_status(status, "the layers")
