"""Vocabulary-parallel embedding and LM head: each rank holds vocab/N rows."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import SINGLE, TensorParallelGroup
from specserve.model_executor.layers import quant_gemm
from specserve.model_executor.layers.fp16_gemm import PackedFp16Weight
from specserve.model_executor.layers.quantized import QuantizedMatrix


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        # Pad the vocabulary up to a multiple of the TP size; padded rows are zero.
        self.padded_vocab = -(-vocab_size // tp.world_size) * tp.world_size
        self.vocab_start, self.vocab_local = tp.shard(self.padded_vocab, "padded vocabulary")
        self.weight = nn.Parameter(torch.empty(self.vocab_local, hidden_size), requires_grad=False)
        # GGUF blocks kept as they are (CPU only; see linear.py): rows are looked up and
        # multiplied through the quantized kernel, and ``weight`` is an empty placeholder.
        self.quantized: QuantizedMatrix | None = None

    def load(self, full) -> None:
        if isinstance(full, QuantizedMatrix):
            rows = full.row_slice(self.vocab_start, self.vocab_local)
            self.quantized = rows.pad_rows(self.vocab_local - rows.shape[0])   # padded rows are zero
            self.weight.data = torch.empty(0)
            return
        local = torch.zeros(self.vocab_local, full.shape[1], dtype=full.dtype)
        rows = full[self.vocab_start : self.vocab_start + self.vocab_local]
        local[: rows.shape[0]] = rows
        self.weight.data = local

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.embedding(ids)
        return F.embedding(ids, self.weight)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp.world_size == 1:
            return self._lookup(token_ids)
        local_ids = token_ids - self.vocab_start
        mine = (local_ids >= 0) & (local_ids < self.vocab_local)
        out = self._lookup(local_ids.clamp(0, self.vocab_local - 1))
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ E.T, gathered on rank 0 and trimmed to the real vocab.

    Only the driver (rank 0) samples, so the shards are gathered there alone;
    other ranks get ``None``.
    """

    packed: PackedFp16Weight | None = None  # set by pack_fp16 (CPU, dtype float16)
    # The GGUF blocks in the file's order, kept by pack_for_tiles for readers of rows (an EAGLE
    # head takes its LM head's rows from the target's): a view of the file, not a copy.
    quantized_file_order: QuantizedMatrix | None = None

    def pack_for_tiles(self, release: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Multiply on AMX tiles from now on where the CPU and the format allow (quantized.py);
        ``release`` gets the file's blocks as they are packed."""
        if self.quantized is not None:
            packed = self.quantized.packed_for_tiles(release)
            if packed is not self.quantized:
                self.quantized_file_order, self.quantized = self.quantized, packed

    def pack_fp16(self) -> None:
        """Use the CPU fp16-weight matmul for the logits; ``weight`` becomes its float16 tensor."""
        if self.quantized is not None:   # already in the file's own blocks
            return
        self.packed = PackedFp16Weight(self.weight)
        self.weight.data = self.packed.weight   # the same float16 tensor

    def keep_first_tokens(self, n: int) -> None:
        """Logits for token ids [0, n) only (a draft's reduced vocabulary; TP 1): the other rows
        of the head are dropped, so computing logits costs n / vocab of the full head."""
        if self.tp.world_size != 1:
            raise ValueError("a reduced LM head needs tensor-parallel size 1")
        n = min(n, self.vocab_size)
        if self.quantized is not None:   # packed rows go by 16: the logits are trimmed to n below
            group = quant_gemm.AMX_GROUP if self.quantized.amx_packed else 1
            self.quantized = self.quantized.row_slice(0, -(-n // group) * group)
            if self.quantized_file_order is not None:
                self.quantized_file_order = self.quantized_file_order.row_slice(0, n)
        else:
            self._keep_float_rows(self.weight.data[:n])
        self.vocab_size = self.vocab_local = self.padded_vocab = n

    def keep_tokens(self, ids: torch.Tensor) -> None:
        """Logits for token ids ``ids`` only, in that order ([S] long, each below ``vocab_size``; TP 1):
        column j of the logits is token ids[j]. A draft with another tokenizer drafts only the tokens
        the target's vocabulary shares (token-level intersection), so the other rows of its head
        need not be computed; the logits then cost S / vocab of the full head's."""
        if self.tp.world_size != 1:
            raise ValueError("a reduced LM head needs tensor-parallel size 1")
        ids = ids.to(torch.long).cpu()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids to keep must be in [0, {self.vocab_size})")
        if self.quantized is not None:
            rows = self.quantized_file_order if self.quantized.amx_packed else self.quantized
            if rows is None or rows.amx_packed or len(rows.segments) != 1:
                raise ValueError("the LM head's blocks cannot be cut by rows (several formats, or packed only)")
            kept = rows.take_rows(ids)                                           # [S, row bytes] blocks
            if self.quantized.amx_packed:   # packed rows go by 16: zero rows pad it, trimmed from the logits
                group = quant_gemm.AMX_GROUP
                padded = QuantizedMatrix.cat([kept.pad_rows(-(-kept.shape[0] // group) * group - kept.shape[0])])
                self.quantized_file_order, self.quantized = kept, padded.packed_for_tiles()   # one segment
            else:
                self.quantized = kept
        else:
            self._keep_float_rows(self.weight.data.index_select(0, ids.to(self.weight.device)))
        self.vocab_size = self.vocab_local = self.padded_vocab = ids.numel()

    def _keep_float_rows(self, rows: torch.Tensor) -> None:
        """The head's float weight becomes ``rows`` [S, hidden] (packed again for the fp16 kernel if it was)."""
        self.weight.data = rows.contiguous()
        if self.packed is not None:
            self.packed = PackedFp16Weight(self.weight.data)
            self.weight.data = self.packed.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N, vocab] fp32
        if self.quantized is not None:
            logits = self.quantized.matmul(hidden)               # [N, padded_vocab / tp]
        elif self.packed is not None:
            logits = self.packed(hidden)                         # [N, padded_vocab / tp]
        else:
            logits = F.linear(hidden, self.weight)               # [N, padded_vocab / tp]
        logits = self.tp.gather_last_dim(logits, dst=0)          # [N, padded_vocab] on rank 0
        if logits is None:
            return None
        return logits[:, : self.vocab_size].float()
