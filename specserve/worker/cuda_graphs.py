"""Decode and verification steps as captured CUDA graphs, replayed instead of launched op by op.

On a GPU a step of a small model is bound by the host: every layer launches a dozen kernels
from Python, and a 135M-parameter model took 15 ms a step on an H200, where its weights take
about 0.1 ms to read. A CUDA graph records the launches of one forward once and replays them
with one call.

A graph fixes every shape, so steps are cut to *buckets*: ``num_reqs`` requests (the step's
count rounded up to a batch bucket) of ``query_len`` rows each (the step's longest query run
rounded up to a query bucket). Request b owns rows ``b * query_len ..`` of the flat batch;
rows past its own tokens and requests past the step's are padding:
  - padding rows write their K/V to a padding block the KV cache manager never hands out
    (``ModelRunner.allocate_kv_cache(padding_block=True)``), and padding requests have no
    query rows (``query_lens`` 0), so the attention kernel reads nothing for them;
  - the attention kernel writes only a request's own rows; the others are zeros
    (``TritonInputs.padded``), and every other op of the model works row by row, so padding
    never reaches a real row;
  - the LM head runs after the graph, on the rows whose logits are asked for.

What a step changes (token ids, positions, cache slots, block tables, query and context
lengths, tree masks) is copied into static device tensors the graph reads: two host-to-device
copies a step. Attention is the Triton kernel (``triton_attention``), whose grid depends on
the bucket only.

Steps that are not served run eagerly: a prefill chunk longer than the largest query bucket,
more requests than the largest batch bucket, a tree wider than the captured mask words, and
every tree where a layer's sliding window is no wider than those words (the kernel computes
no tree node's ancestors' positions). A bucket is captured the first time a step
needs it (logged once, with its time), so shapes a workload never uses cost nothing.

A draft's greedy drafts 2..k can run as one graph as well (``greedy_chain``): step j feeds
the argmax of step j - 1's logits straight back in on the device, so the host reads all the
drafted tokens once instead of once a draft. Positions, slots and context lengths of every
step are known beforehand; a request whose draft budget ends early writes its later steps to
the padding block. What one step computes is the owner's ``chain_step``: a draft model's
forward and argmax by default, an EAGLE head's (which also carries its output feature to the
next step as a ``state`` row) where the EAGLE proposer sets it.

On a CPU there is nothing to capture; ``capture=False`` runs the same padded static-buffer
forward eagerly, which is how the tests check the padding (``SPECSERVE_GRAPHS_ON_CPU=1``).
"""
from __future__ import annotations

import bisect
import logging
import os
import time
from dataclasses import dataclass

import torch

from specserve.model_executor.layers import triton_attention
from specserve.model_executor.layers.attention import AttentionMetadata, cache_slot, mask_words_int32, tree_layout
from specserve.model_executor.layers.triton_attention import TritonInputs

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
QUERY_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)


def graphs_on_cpu() -> bool:
    """Tests only: the padded static-buffer forward runs eagerly on a CPU."""
    return os.environ.get("SPECSERVE_GRAPHS_ON_CPU", "") == "1"


def graphs_possible(device: torch.device | str, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` with these query and cache dtypes can replay graphs: CUDA (or,
    in the tests, a CPU with ``SPECSERVE_GRAPHS_ON_CPU=1``) and the Triton attention kernel."""
    device = torch.device(device)
    if device.type != "cuda" and not (device.type == "cpu" and graphs_on_cpu()):
        return False
    return triton_attention.usable(device, dtype, cache_dtype)


def buckets_up_to(buckets: tuple[int, ...], largest: int) -> list[int]:
    """The buckets below ``largest``, then ``largest`` itself (so that it is served exactly)."""
    return [b for b in buckets if b < largest] + [largest]


@dataclass(frozen=True)
class Bucket:
    num_reqs: int
    query_len: int

    @property
    def rows(self) -> int:
        return self.num_reqs * self.query_len


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph | None"   # None: run eagerly (a CPU)
    hidden: torch.Tensor | None            # the graph's output (CUDA): [rows, hidden], a chain's [steps, B] tokens


class StepGraphs:
    """The captured forwards of one ``ModelRunner`` and the static tensors they read."""

    def __init__(self, runner, max_num_reqs: int, max_query_len: int, max_tree_span: int, capture: bool,
                 max_chain_steps: int = 0, chain_step=None):
        """``runner``: a ModelRunner whose cache has a padding block (or any owner with its
        ``device``, ``block_size``, ``max_model_len``, ``padding_block``, ``model`` and
        ``kv_caches``). ``chain_step(ids [B], state [B, H] or None, meta, positions [B]) ->
        (next ids [B], next state or None)``: one step of a greedy chain (default: the decoder's
        forward, LM head and argmax). Steps of up to
        ``max_num_reqs`` requests of up to ``max_query_len`` rows are served; trees up to
        ``max_tree_span`` slots (cached nodes + new ones; 0: chains only); greedy chains of up
        to ``max_chain_steps`` decode steps (a draft model's; 0: none)."""
        self.runner = runner
        self.capture = capture
        self.batch_buckets = buckets_up_to(BATCH_BUCKETS, max_num_reqs)
        self.query_buckets = buckets_up_to(QUERY_BUCKETS, max_query_len)
        self.smallest_window = min((w for w in _sliding_windows(runner.model) if w is not None), default=None)
        self.num_words = -(-max_tree_span // 32) if max_tree_span else 0
        if self.num_words and self.smallest_window is not None and self.smallest_window <= 32 * self.num_words:
            self.num_words = 0   # the kernel cannot apply such a window inside a tree: tree steps run eagerly
        self.max_tree_span = 32 * self.num_words
        b_max, q_max = self.batch_buckets[-1], self.query_buckets[-1]
        rows = b_max * q_max
        # A table reaches past max_model_len by a step's lookahead slots (a tree's nodes sit at
        # slots beyond their positions), as the KV cache manager sizes a request (start_up.kv_cache_blocks).
        lookahead = max(max_query_len, max_tree_span, max_chain_steps + 1)
        self.max_blocks = -(-(runner.max_model_len + lookahead) // runner.block_size)
        self.pad_slot = runner.padding_block * runner.block_size
        device = runner.device
        # One int64 and one int32 tensor hold every input, so a step copies them in two transfers.
        self.i64 = torch.zeros(3 * rows, dtype=torch.long, device=device)
        self.ids, self.positions, self.slots = self.i64.view(3, rows)
        n32 = b_max * (self.max_blocks + 4) + rows * self.num_words
        self.i32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self.block_tables = self.i32[: b_max * self.max_blocks].view(b_max, self.max_blocks)
        self.query_start, self.query_lens, self.context_lens, self.tree_back = (
            self.i32[b_max * self.max_blocks : b_max * (self.max_blocks + 4)].view(4, b_max))
        self.tree_words = (self.i32[b_max * (self.max_blocks + 4) :].view(rows, self.num_words)
                           if self.num_words else None)
        # A greedy chain's inputs: the first tokens, then per step positions and slots (int64),
        # context and query lengths (int32); query starts are 0, 1, 2, ... (one row a request).
        self.max_chain_steps = max_chain_steps
        steps = max(1, max_chain_steps)
        self.c64 = torch.zeros(1 + 2 * steps, b_max, dtype=torch.long, device=device)
        self.chain_ids, self.chain_positions, self.chain_slots = (self.c64[0], self.c64[1 : 1 + steps],
                                                                  self.c64[1 + steps :])
        self.c32 = torch.zeros(2 * steps, b_max, dtype=torch.int32, device=device)
        self.chain_context_lens, self.chain_query_lens = self.c32[:steps], self.c32[steps:]
        self.chain_query_start = torch.arange(b_max, dtype=torch.int32, device=device)
        self.chain_step = chain_step or self._decoder_chain_step
        self.chain_state: torch.Tensor | None = None   # [B_max, H] a chain's first state rows (EAGLE's features)
        self.captured: dict[Bucket, _Captured] = {}
        self.chains: dict[tuple[int, int], _Captured] = {}   # (requests bucket, steps) -> greedy chain
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    # ------------------------------------------------------------------ which steps
    def bucket_for(self, inputs: list) -> Bucket | None:
        """The bucket a step runs in, or None when it runs eagerly."""
        if not inputs or len(inputs) > self.batch_buckets[-1]:
            return None
        longest = max(len(inp.token_ids) for inp in inputs)
        if longest == 0 or longest > self.query_buckets[-1]:
            return None
        bs = self.runner.block_size
        for inp in inputs:   # a tree wider than the mask words (none where a window forbids trees)
            if inp.tree_parents is not None and inp.tree_cached + len(inp.token_ids) > self.max_tree_span:
                return None
            if -(-(inp.start_position + len(inp.token_ids)) // bs) > self.max_blocks:   # past the static table
                return None
        return Bucket(self.batch_buckets[bisect.bisect_left(self.batch_buckets, len(inputs))],
                      self.query_buckets[bisect.bisect_left(self.query_buckets, longest)])

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def run(self, bucket: Bucket, inputs: list) -> tuple[torch.Tensor, list[int], list[int]]:
        """The step through the bucket's graph: the final hidden states of every row
        [bucket rows, hidden] (the graph's own output tensor, valid until its next replay),
        the rows whose logits the inputs ask for, and the rows of their tokens, each in
        ``ModelRunner.execute``'s order."""
        logit_rows, token_rows = self._fill(bucket, inputs)
        captured = self.captured.get(bucket)
        if captured is None:
            captured = self.captured[bucket] = self._capture(lambda: self._forward(bucket),
                                                             f"{bucket.num_reqs} requests x {bucket.query_len} rows")
        if captured.graph is None:
            return self._forward(bucket), logit_rows, token_rows
        captured.graph.replay()
        return captured.hidden, logit_rows, token_rows

    def _fill(self, bucket: Bucket, inputs: list) -> tuple[list[int], list[int]]:
        """Copy the step into the static tensors; returns the rows whose logits are asked for
        and the rows of real tokens, in the order ``ModelRunner.execute`` gives them."""
        q, rows = bucket.query_len, bucket.rows
        ids = [0] * rows
        positions = [0] * rows
        slots = [self.pad_slot] * rows
        starts = [b * q for b in range(bucket.num_reqs)]
        q_lens = [0] * bucket.num_reqs
        ctx_lens = [0] * bucket.num_reqs
        backs = [-1] * bucket.num_reqs
        masks = [0] * rows   # each row's ancestor mask (trees)
        tables: list[list[int]] = []
        logit_rows: list[int] = []
        token_rows: list[int] = []
        bs = self.runner.block_size
        for b, inp in enumerate(inputs):
            n, first_row = len(inp.token_ids), b * q
            ctx = inp.start_position + n
            q_lens[b], ctx_lens[b] = n, ctx
            if inp.tree_parents is None:
                positions[first_row : first_row + n] = range(inp.start_position, ctx)
            else:
                depths, node_masks = tree_layout(inp.tree_parents)
                tree_start = inp.start_position - inp.tree_cached
                positions[first_row : first_row + n] = [tree_start + d for d in depths[inp.tree_cached:]]
                backs[b] = inp.tree_cached
                masks[first_row : first_row + n] = node_masks[inp.tree_cached:]
            last = max(positions[first_row : first_row + n], default=-1)
            if last >= self.runner.max_model_len:   # as the eager step refuses it (past the rotary table)
                raise ValueError(f"position {last} beyond max_model_len ({self.runner.max_model_len})")
            ids[first_row : first_row + n] = inp.token_ids
            slots[first_row : first_row + n] = [cache_slot(inp.block_table, p, bs) for p in range(inp.start_position, ctx)]
            tables.append(inp.block_table[: -(-ctx // bs)])
            logit_rows.extend(range(first_row + n - inp.num_logits, first_row + n))
            token_rows.extend(range(first_row, first_row + n))
        host64 = torch.tensor([ids, positions, slots], dtype=torch.long)            # [3, rows]
        self.i64.view(3, -1)[:, :rows].copy_(host64, non_blocking=True)
        b_max = self.batch_buckets[-1]
        # Only the columns some request uses: the kernel reads a row up to its context's block.
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)   # [B_step, width]
        self.block_tables[: len(tables), :width].copy_(table, non_blocking=True)
        meta4 = torch.tensor([starts, q_lens, ctx_lens, backs], dtype=torch.int32)    # [4, B]
        self.i32[b_max * self.max_blocks : b_max * (self.max_blocks + 4)].view(4, b_max)[:, : bucket.num_reqs].copy_(
            meta4, non_blocking=True)
        if self.num_words:
            self.tree_words[:rows].copy_(mask_words_int32(masks, self.num_words), non_blocking=True)
        return logit_rows, token_rows

    def _meta(self, bucket: Bucket) -> AttentionMetadata:
        b, rows = bucket.num_reqs, bucket.rows
        tri = TritonInputs(
            block_tables=self.block_tables[:b], query_start=self.query_start[:b], query_lens=self.query_lens[:b],
            context_lens=self.context_lens[:b], positions=self.positions[:rows], max_query_len=bucket.query_len,
            tree_back=self.tree_back[:b] if self.num_words else None,
            tree_words=self.tree_words[:rows] if self.num_words else None,
            tree_span=self.max_tree_span, padded=True)
        return AttentionMetadata(slot_mapping=self.slots[:rows], kernel=None, _group_args=(), triton=tri)

    def _forward(self, bucket: Bucket) -> torch.Tensor:   # [rows, hidden]
        rows = bucket.rows
        return self.runner.model(self.ids[:rows], self.positions[:rows], self.runner.kv_caches, self._meta(bucket))

    # ------------------------------------------------------------------ a draft's greedy chain
    def chain_bucket(self, num_reqs: int, steps: int) -> int | None:
        """The requests bucket a greedy chain of ``steps`` runs in, or None (run step by step)."""
        if not 0 < steps <= self.max_chain_steps or num_reqs > self.batch_buckets[-1]:
            return None
        return self.batch_buckets[bisect.bisect_left(self.batch_buckets, num_reqs)]

    @torch.inference_mode()
    def greedy_chain(self, num_reqs: int, first_tokens: list[int], positions: list[int], tables: list[list[int]],
                     steps: list[int], first_state: torch.Tensor | None = None) -> list[list[int]]:
        """Request i feeds ``first_tokens[i]`` (with ``first_state[i]``, for a chain step that
        carries one) at ``positions[i]`` and each next argmax after it, for ``steps[i]`` decode
        steps (``chain_bucket(len, max(steps))`` gave ``num_reqs``); returns the argmax tokens of
        its steps. One host read for all of them."""
        longest = max(steps)
        bs = self.runner.block_size
        pos = [[0] * num_reqs for _ in range(longest)]
        slots = [[self.pad_slot] * num_reqs for _ in range(longest)]
        ctx = [[0] * num_reqs for _ in range(longest)]
        q = [[0] * num_reqs for _ in range(longest)]
        for i, (p0, table, n) in enumerate(zip(positions, tables, steps)):
            for j in range(n):
                pos[j][i], slots[j][i], ctx[j][i], q[j][i] = p0 + j, cache_slot(table, p0 + j, bs), p0 + j + 1, 1
        ids = first_tokens + [0] * (num_reqs - len(first_tokens))
        self.c64[0, :num_reqs].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        host = torch.tensor([pos, slots], dtype=torch.long)                          # [2, steps, B]
        self.chain_positions[:longest, :num_reqs].copy_(host[0], non_blocking=True)
        self.chain_slots[:longest, :num_reqs].copy_(host[1], non_blocking=True)
        host = torch.tensor([ctx, q], dtype=torch.int32)
        self.chain_context_lens[:longest, :num_reqs].copy_(host[0], non_blocking=True)
        self.chain_query_lens[:longest, :num_reqs].copy_(host[1], non_blocking=True)
        width = max(len(t) for t in tables)
        self.block_tables[: len(tables), :width].copy_(
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32), non_blocking=True)
        if first_state is not None:
            if self.chain_state is None:
                self.chain_state = first_state.new_zeros(self.batch_buckets[-1], first_state.shape[1])
            self.chain_state[: first_state.shape[0]].copy_(first_state)
        key = (num_reqs, longest)
        captured = self.chains.get(key)
        if captured is None:
            captured = self.chains[key] = self._capture(lambda: self._chain_forward(num_reqs, longest),
                                                        f"a greedy chain of {longest} steps x {num_reqs} requests")
        if captured.graph is None:
            tokens = self._chain_forward(num_reqs, longest)
        else:
            captured.graph.replay()
            tokens = captured.hidden
        tokens = tokens.tolist()                                                     # [steps][B]: the one host read
        return [[tokens[j][i] for j in range(n)] for i, n in enumerate(steps)]

    def _chain_forward(self, num_reqs: int, steps: int) -> torch.Tensor:   # [steps, num_reqs] token ids
        b = num_reqs
        ids, out = self.chain_ids[:b], []
        state = self.chain_state[:b] if self.chain_state is not None else None
        for j in range(steps):
            tri = TritonInputs(
                block_tables=self.block_tables[:b], query_start=self.chain_query_start[:b],
                query_lens=self.chain_query_lens[j, :b], context_lens=self.chain_context_lens[j, :b],
                positions=self.chain_positions[j, :b], max_query_len=1, padded=True)
            meta = AttentionMetadata(slot_mapping=self.chain_slots[j, :b], kernel=None, _group_args=(), triton=tri)
            ids, state = self.chain_step(ids, state, meta, self.chain_positions[j, :b])
            out.append(ids)
        return torch.stack(out)

    def _decoder_chain_step(self, ids, state, meta, positions):
        model = self.runner.model
        hidden = model(ids, positions, self.runner.kv_caches, meta)                       # [b, hidden]
        return model.compute_logits(hidden).argmax(dim=-1), None

    # ------------------------------------------------------------------ capture
    def _capture(self, forward, what: str) -> _Captured:
        """``forward``'s launches as a CUDA graph (its output tensor kept), or on a CPU nothing."""
        if not self.capture:
            return _Captured(None, None)
        start = time.perf_counter()
        static = tuple(t for t in (self.i64, self.i32, self.c64, self.c32, self.chain_state) if t is not None)
        saved = [t.clone() for t in static]
        # Capture with nothing to attend (no query rows) and every write to the padding block.
        for slots in (self.slots, self.chain_slots):
            slots.fill_(self.pad_slot)
        for lens in (self.query_lens, self.context_lens, self.chain_query_lens, self.chain_context_lens):
            lens.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        for t, old in zip(static, saved):
            t.copy_(old)
        logger.info("captured a CUDA graph for %s in %.2f s (%d graphs)", what, time.perf_counter() - start,
                    len(self.captured) + len(self.chains) + 1)
        return _Captured(graph, output)


def _sliding_windows(model) -> list[int | None]:
    return [getattr(getattr(layer, "self_attn", None), "sliding_window", None) for layer in getattr(model, "layers", [])]
