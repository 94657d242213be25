"""The EAGLE proposer: a one-layer head over the target's hidden states.

The head (``model_executor/models/eagle.py``) has its own one-layer KV cache
but shares the target's block tables, like the draft-model proposer, so the
scheduler's lookahead slots and preemption cover it. Its position t holds
``fc([f_t ; embed(x_{t+1})])``, where ``f_t`` is the target's final hidden state
at t, so it can only be computed once the target has computed t AND the token
after it is known.

Each step, for every decoding request with ``n = num_computed_tokens`` (the
target has positions 0..n-1; token n is the one just sampled):

1. catch up: one head forward over positions ``proposer_num_computed_tokens``
   .. n-1 with the target's real features (from ``observe``) and tokens
   x_{p+1}; the last position's output gives draft 1. (With prefix caching, a
   prefill's positions but its last, and a finished request's positions, are
   computed in ``observe``, right after the target's step, so their blocks can
   be shared whether or not the request drafts: the cached blocks carry the
   head's K/V, ``core/kv_cache_manager.py``.);
2. drafts 2..k: single-position forwards at n, n+1, ... that feed the head's
   own output back in as the feature (no target feature exists there yet).

Only positions computed from real target features count as computed: after
drafting, ``proposer_num_computed_tokens`` is n, so the draft positions are
recomputed (overwritten) with real features after verification.

With a ``TreeConfig`` the head proposes a tree (``draft_tree``): the catch-up's last
output is the root (position n - 1), and a node at depth d is fed at position
n - 1 + d with its parent's output as its feature, one batched tree-attention
forward per depth. The accepted branch's positions are recomputed from the
target's real features as above (the head's own K/V there came from guessed
features), so its K/V is not moved; the target's hidden states of a tree step
arrive whole and the accepted branch's rows are picked (``keep_tree_branch``).
"""
from __future__ import annotations

import logging
import weakref

import torch

from specserve.config import TreeConfig
from specserve.core.kv_cache_manager import PROPOSER_KV_FROM_FEATURES, KVCacheManager
from specserve.core.request import Request
from specserve.core.scheduler import ScheduledRequest
from specserve.model_executor.layers.attention import (AttentionMetadata, copy_cache_slots, kv_cache_dtype_for,
                                                       kv_cache_shape, tree_layout)
from specserve.model_executor.layers.fp16_gemm import compute_dtype_for, round_to_weight_dtype, skip_row_padding
from specserve.model_executor.layers.linear import ColumnParallelLinear
from specserve.model_executor.layers.quantized import QuantizedMatrix
from specserve.model_executor.models.eagle import EagleHead
from specserve.model_executor.models.eagle3 import Eagle3Head
from specserve.sample.penalties import adjust_request_rows
from specserve.sample.sampler import CHOICE, choose_tokens, keyed_generator, row_argmax
from specserve.spec_decode.checks import check_vocab
from specserve.spec_decode.context import ProposerContext
from specserve.spec_decode.draft_tree import DraftTreeGrower, TreeStep
from specserve.spec_decode.proposer import Proposal, Proposer, TargetHidden, drafts_by_argmax
from specserve.structured_output.rows import mask_draft_rows
from specserve.worker.cuda_graphs import StepGraphs, graphs_possible

logger = logging.getLogger(__name__)


class _Features:
    """The target's hidden states of one request at positions [start, start + len(rows))."""

    def __init__(self, start: int, rows: torch.Tensor):
        self.start = start
        self.rows = rows

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]

    def add(self, start: int, rows: torch.Tensor) -> None:
        if self.start <= start <= self.end:  # a continuation (or a rewrite of the tail)
            self.rows = torch.cat([self.rows[: start - self.start], rows])
        else:  # a gap or a restart (preemption recomputes from 0): keep only the new rows
            self.start, self.rows = start, rows

    def get(self, start: int, end: int) -> torch.Tensor | None:
        if start < self.start or end > self.end:
            return None
        return self.rows[start - self.start : end - self.start]

    def drop_before(self, position: int) -> None:
        if position > self.start:
            self.rows = self.rows[position - self.start :]
            self.start = position


class EagleProposer(Proposer):
    needs_target_hidden = True
    takes_tree_hidden = True
    runs_beams = True     # its K/V follows the target's block tables; a forked beam gets its features (fork)
    cached_kv = PROPOSER_KV_FROM_FEATURES

    def __init__(
        self,
        head: EagleHead,
        embed_tokens: torch.nn.Module,     # the target's embedding (frozen, shared)
        lm_head_weight,                    # [V, H] the target's LM head rows (a tensor or QuantizedMatrix)
        kv_cache: KVCacheManager,
        vocab_size: int,
        device: torch.device,
        weight_dtype: torch.dtype,
        block_size: int,
        tree: TreeConfig | None = None,
        depth: int = 0,
        graphs: bool = False,
        max_num_seqs: int = 1,
        max_model_len: int = 0,
    ):
        """``head`` arrives in the compute dtype for ``weight_dtype`` (fp16_gemm.compute_dtype_for).
        ``graphs``: greedy drafts 2..``depth`` as one CUDA graph where the device allows
        (``cuda_graphs.graphs_possible``), for up to ``max_num_seqs`` requests."""
        self.dtype = dtype = compute_dtype_for(weight_dtype, device)
        self.head = head.to(device).eval()
        # an EAGLE-3 head may carry its own embedding; else the target's
        self.embed_tokens = getattr(head, "embed_tokens", None) or embed_tokens
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        self.device = device
        self.block_size = block_size
        vocab = head.draft_vocab
        self.draft_vocab = vocab.to(device) if vocab is not None else None            # [Vd] target ids
        if isinstance(head, Eagle3Head):      # its own LM head over its draft vocabulary
            self.lm_head = head.lm_head
        else:                                 # the target's LM head, its draft vocabulary's rows
            if isinstance(lm_head_weight, QuantizedMatrix):   # the target's GGUF blocks, rows taken as they are
                rows = lm_head_weight.row_slice(0, vocab_size) if vocab is None else lm_head_weight.take_rows(vocab)
            else:
                rows = lm_head_weight[: vocab_size] if vocab is None else lm_head_weight[vocab.to(lm_head_weight.device)]
            self.lm_head = ColumnParallelLinear(rows.shape[1], [rows.shape[0]], bias=False)   # [Vd, H], not sharded
            self.lm_head.load([rows.to(dtype=dtype)])
        self.lm_head.to(device)
        round_to_weight_dtype(self.head, weight_dtype, dtype, device)
        round_to_weight_dtype(self.lm_head, weight_dtype, dtype, device)
        skip_row_padding(self.head)
        skip_row_padding(self.lm_head)
        cfg = head.config
        kv_dtype = kv_cache_dtype_for(weight_dtype, dtype, device)
        chain = graphs and tree is None and depth > 1 and graphs_possible(device, dtype, kv_dtype)
        # With graphs, one more block: the padding block a chain's padding rows write (cuda_graphs)
        shape = kv_cache_shape(kv_cache.num_blocks + int(chain), block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=kv_dtype, device=device)
        # What StepGraphs reads of its owner (a ModelRunner's names).
        self.model, self.kv_caches, self.max_model_len = self.head, [self.kv], max_model_len
        self.padding_block = kv_cache.num_blocks
        self.graphs = (StepGraphs(self, max_num_seqs, 1, 0, capture=torch.device(device).type == "cuda",
                                  max_chain_steps=depth - 1, chain_step=self._chain_step) if chain else None)
        self.features: weakref.WeakKeyDictionary[Request, _Features] = weakref.WeakKeyDictionary()
        self._warned = False
        self.tree = DraftTreeGrower(tree, depth, vocab_size) if tree is not None else None
        self.branches: weakref.WeakKeyDictionary[Request, list[int]] = weakref.WeakKeyDictionary()
        # Beams forked off a request this step, with their paths: they get its step's rows in observe.
        self.forks: weakref.WeakKeyDictionary[Request, list[tuple[Request, list[int], int]]] = \
            weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ hooks
    def observe(self, states: list[TargetHidden]) -> None:
        for st in states:
            req = st.request
            for child, path, last in self.forks.pop(req, []):   # before the parent's own rows are stored
                self._give_fork_features(req, st, child, path, last)
            if st.tree_rows is not None:   # a tree step: the accepted branch's rows, root first
                kept = max(req.num_computed_tokens - st.start_position, 0)
                rows = _path_rows(1, self.branches.pop(req, []), kept)
                st = TargetHidden(req, st.start_position, st.tree_rows[rows.to(st.tree_rows.device)])
            if st.hidden.shape[0] == 0 or (req.is_finished() and self.kv_cache.proposer_kv is None):
                continue
            feats = self.features.get(req)
            if feats is None:
                self.features[req] = _Features(st.start_position, st.hidden)
            else:
                feats.add(st.start_position, st.hidden)
        self._catch_up_for_cache(states)

    def keep_tree_branch(self, request: Request, path: list[int], last: int) -> None:
        self.branches[request] = list(path)   # observe() picks these rows of the tree's hidden states

    def copy_kv_slots(self, src: list[int], dst: list[int]) -> None:
        copy_cache_slots(self.kv_caches, src, dst)

    def fork(self, parent: Request, child: Request, path: list[int], last: int) -> None:
        self.forks.setdefault(parent, []).append((child, list(path), last))

    def _give_fork_features(self, parent: Request, st: TargetHidden, child: Request, path: list[int],
                            last: int) -> None:
        """A forked beam's features: what the parent stored from the child's first uncomputed
        position on, then the parent's rows of this step up to its last token (position ``last``:
        a prefill's whole chunk, a verification's one row) and along the child's path of drafts,
        up to what the child has computed. The head's K/V below sits in the blocks the fork
        shared or copied. A child that computes its context again (no room at the fork) gets its
        features from that prefill."""
        start, kept = child.proposer_num_computed_tokens, child.num_computed_tokens - st.start_position
        if kept <= 0 or start > st.start_position:
            return
        rows = st.tree_rows if st.tree_rows is not None else st.hidden            # [n, H], the step's order
        index = _path_rows(last + 1 - st.start_position, path, kept)
        if index.numel() < kept or int(index.max()) >= rows.shape[0]:
            return      # the step did not compute all of the child's positions: nothing to hand over
        new = rows[index.to(rows.device)]                                          # [kept, H]
        if start < st.start_position:
            stored = self.features.get(parent)
            before = stored.get(start, st.start_position) if stored is not None else None
            if before is None:
                return
            new = torch.cat([before, new])
        self.features[child] = _Features(start, new)

    # --------------------------------------------------------------- drafting
    def _forward(self, features, token_ids, positions, query_lens, context_lens, block_tables,
                 tree_masks=None, tree_back=None) -> torch.Tensor:
        meta = AttentionMetadata.build(query_lens, context_lens, block_tables, self.block_size, self.device, self.dtype,
                                       self.kv.dtype, tree_masks, tree_back)
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        embeds = self.embed_tokens(ids).to(self.dtype)
        return self.head(features.to(self.dtype), embeds, pos, self.kv, meta)   # [T, H]

    def _choose(self, hidden: torch.Tensor, rows: list[int], reqs: list[Request], drafts: list[list[int]]):
        """hidden [n, H] of requests ``rows`` -> (tokens, probs [n, V] or None when all greedy).

        ``drafts``: every request's draft tokens so far (penalties count them)."""
        logits = self.lm_head(self.head.logits_input(hidden)).float()                   # [n, Vd]
        params = [reqs[i].sampling_params for i in rows]
        adjusts = any(p.adjusts_logits for p in params)
        constrained = any(reqs[i].grammar is not None for i in rows)
        if all(p.greedy for p in params) and not adjusts and not constrained:
            best = row_argmax(logits)
            tokens = self.draft_vocab[best] if self.draft_vocab is not None else best
            return tokens.tolist(), None
        if self.draft_vocab is not None:  # tokens outside the draft vocabulary get probability 0
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, self.draft_vocab] = logits
            logits = full
        if adjusts:
            logits = adjust_request_rows(logits, [reqs[i] for i in rows],
                                         [reqs[i].output_token_ids + drafts[i] for i in rows])
        if constrained:   # structured output: drafts under the request's grammar
            logits = mask_draft_rows(logits, [reqs[i] for i in rows], [drafts[i] for i in rows])
        # A draft guesses output token num_output_tokens + (drafts so far) with that token's own noise.
        generators = [keyed_generator(reqs[i].seed, reqs[i].num_output_tokens + len(drafts[i]), CHOICE, logits.device)
                      for i in rows]
        choice = choose_tokens(logits, params, generators)
        return choice.tokens, choice.probs                                             # probs [n, V] or None

    def _full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, V] over the target's vocabulary (-inf outside a reduced draft vocabulary)."""
        logits = self.lm_head(self.head.logits_input(hidden)).float()                    # [n, Vd]
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_vocab] = logits
        return full

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        reqs = [s.request for s in scheduled]
        budgets = [s.num_lookahead for s in scheduled]
        if self.tree is not None:
            return self._propose_trees(reqs, budgets)
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active, hidden = self._catch_up(reqs, budgets)   # 1. catch up on real features
        if not active:
            return Proposal(token_ids=drafts, probs=[None] * len(reqs))

        # 2. Draft: each step's output feature and token feed the next position.
        step = 0
        while True:
            tokens, q = self._choose(hidden, active, reqs, drafts)
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if q is not None and not reqs[i].sampling_params.greedy:
                    probs[i].append(q[row])
            keep = [row for row, i in enumerate(active) if len(drafts[i]) < budgets[i]]
            if not keep:
                break
            if step == 0 and self._greedy_chain(reqs, [active[row] for row in keep], hidden[keep], drafts, budgets):
                break
            active = [active[row] for row in keep]
            hidden = hidden[torch.tensor(keep, device=self.device)]
            pos = [reqs[i].num_computed_tokens + step for i in active]
            hidden = self._forward(
                hidden,
                [drafts[i][-1] for i in active],
                pos,
                [1] * len(active),
                [p + 1 for p in pos],
                [self.kv_cache.block_table(reqs[i].request_id) for i in active],
            )
            step += 1
        return Proposal(token_ids=drafts, probs=[torch.stack(p) if p else None for p in probs])

    def _greedy_chain(self, reqs: list[Request], active: list[int], hidden: torch.Tensor, drafts: list[list[int]],
                      budgets: list[int]) -> bool:
        """Drafts 2.. in one captured graph (``StepGraphs.greedy_chain`` with ``_chain_step``), from
        the catch-up's output features ``hidden`` [len(active), H], where there is one for this
        batch and every active request drafts greedily with nothing adjusting or masking its
        logits; extends ``drafts`` and returns True, else False (the caller steps on)."""
        steps = [budgets[i] - len(drafts[i]) for i in active]
        bucket = self.graphs.chain_bucket(len(active), max(steps)) if self.graphs is not None else None
        if bucket is None or not all(drafts_by_argmax(reqs[i]) for i in active):
            return False
        tokens = self.graphs.greedy_chain(bucket, [drafts[i][-1] for i in active],
                                          [reqs[i].num_computed_tokens for i in active],
                                          [self.kv_cache.block_table(reqs[i].request_id) for i in active], steps,
                                          first_state=hidden)
        for i, new in zip(active, tokens):
            drafts[i].extend(new)
        return True

    def _chain_step(self, ids: torch.Tensor, state: torch.Tensor, meta, positions: torch.Tensor):
        """One greedy draft on the device: the head at the fed token with the last output as its
        feature, then the argmax of the LM head (ids, state [B], [B, H] -> the next ones)."""
        state = self.head(state.to(self.dtype), self.embed_tokens(ids).to(self.dtype), positions, self.kv, meta)
        best = row_argmax(self.lm_head(self.head.logits_input(state)).float())
        return (self.draft_vocab[best] if self.draft_vocab is not None else best), state

    def _propose_trees(self, reqs: list[Request], budgets: list[int]) -> Proposal:
        """Catch up, then grow each request's tree under its root at position n - 1."""
        active, root_hidden = self._catch_up(reqs, budgets)
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[torch.Tensor | None] = [None] * len(reqs)
        parents: list[list[int] | None] = [[] for _ in reqs]
        if not active:
            return Proposal(token_ids=drafts, probs=probs, parents=parents)
        tables = [self.kv_cache.block_table(reqs[i].request_id) for i in active]
        outputs = {(j, 0): root_hidden[j] for j in range(len(active))}   # (request, tree slot) -> head output

        def forward(steps: list[TreeStep]) -> torch.Tensor:
            feats, tokens, positions, masks, backs = [], [], [], [], []
            for st in steps:
                depths, tree_masks = tree_layout(st.span_parents)
                tree_start = st.start_position - st.tree_cached
                feats += [outputs[st.index, slot] for slot in st.parent_slots]
                tokens += st.token_ids
                positions += [tree_start + d for d in depths[st.tree_cached:]]
                masks.append(tree_masks[st.tree_cached:])
                backs.append(st.tree_cached)
            hidden = self._forward(torch.stack(feats), tokens, positions, [len(st.token_ids) for st in steps],
                                   [st.start_position + len(st.token_ids) for st in steps],
                                   [tables[st.index] for st in steps], masks, backs)            # [T, H]
            row = 0
            for st in steps:
                for j in range(len(st.token_ids)):
                    outputs[st.index, st.tree_cached + j] = hidden[row + j]
                row += len(st.token_ids)
            return self._full_logits(hidden)

        grown = self.tree.grow([reqs[i] for i in active], [budgets[i] for i in active], self._full_logits(root_hidden),
                               forward, roots=[reqs[i].num_computed_tokens - 1 for i in active])
        for j, i in enumerate(active):
            drafts[i], probs[i], parents[i] = grown.token_ids[j], grown.probs[j], grown.parents[j]
        return Proposal(token_ids=drafts, probs=probs, parents=parents)

    def _catch_up(self, reqs: list[Request], budgets: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """One head forward over positions [proposer_num_computed_tokens, num_computed_tokens) with
        the target's real features -> (requests drafting, their last position's output [n, H])."""
        wanted = [i for i in range(len(reqs)) if budgets[i] > 0]
        drafting = [reqs[i] for i in wanted]
        active, hidden = self._head_over_features(drafting, [r.num_computed_tokens for r in drafting])
        return [wanted[j] for j in active], hidden

    def _catch_up_for_cache(self, states: list[TargetHidden]) -> None:
        """With prefix caching, after a step: the head computes the positions of a prefill (or a
        preempted request's recomputation), all but the last (the next drafting's catch-up
        computes that one and drafts from it), and every position of a request that finished in
        the step (its blocks are held until the step's end). Its K/V in their blocks is then
        final, so prefix caching can share them (``core/kv_cache_manager.py``) whether or not the
        request drafted."""
        if self.kv_cache.proposer_kv is None:   # no prefix caching: the first draft's catch-up does it
            return
        reqs, ends = [], []
        for st in states:
            r = st.request
            if r.is_finished():      # every token is known: all it computed, if its blocks are still held
                end = min(r.num_computed_tokens, r.num_tokens - 1)
                if self.kv_cache.blocks_for(end) > len(self.kv_cache.block_table(r.request_id)):
                    continue
            elif st.start_position < r.num_prompt_tokens:
                end = r.num_computed_tokens - 1
            else:
                continue
            if r in self.features:
                reqs.append(r)
                ends.append(end)
        self._head_over_features(reqs, ends)

    def _head_over_features(self, reqs: list[Request], ends: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """One head forward over positions [proposer_num_computed_tokens, ends[i]) of each request,
        from the target's real features and the token after each position -> (the requests it ran
        for, their last position's output [n, H])."""
        active, feats, token_ids, positions, q_lens, ctx_lens, tables = [], [], [], [], [], [], []
        for i, (r, end) in enumerate(zip(reqs, ends)):
            start = r.proposer_num_computed_tokens
            if end <= start:
                continue  # nothing new computed by the target (a one-token prompt's first step)
            stored = self.features.get(r)
            rows = stored.get(start, end) if stored is not None else None
            if rows is None:  # should not happen: every kept position is observed
                if not self._warned:
                    logger.warning("EAGLE: no target hidden states for request %s; not drafting", r.request_id)
                    self._warned = True
                continue
            active.append(i)
            feats.append(rows)
            token_ids.extend(r.all_token_ids[start + 1 : end + 1])
            positions.extend(range(start, end))
            q_lens.append(end - start)
            ctx_lens.append(end)
            tables.append(self.kv_cache.block_table(r.request_id))
        if not active:
            return [], None
        hidden = self._forward(torch.cat(feats), token_ids, positions, q_lens, ctx_lens, tables)
        last = torch.tensor(q_lens).cumsum(0) - 1
        hidden = hidden[last.to(self.device)]                                         # [len(active), H]
        for i in active:
            r = reqs[i]
            r.proposer_num_computed_tokens = ends[i]
            self.features[r].drop_before(ends[i])
        return active, hidden


def _path_rows(own: int, path: list[int], kept: int) -> torch.Tensor:
    """[<= kept] rows of a step's hidden states, in position order, for a request that kept
    ``kept`` positions along ``path``: the ``own`` rows it fed before its drafts (the last token,
    or a prefill chunk ending with it), then drafts ``path`` (indices among the drafts)."""
    return torch.tensor((list(range(own)) + [own + p for p in path])[:kept], dtype=torch.long)


def build_eagle_proposer(spec, ctx: ProposerContext) -> EagleProposer:
    """SpeculativeConfig(method="eagle", model=FOLDER) + the target's context -> an EagleProposer
    over specserve's EAGLE head or a vLLM-format EAGLE-3 head, as the folder holds."""
    from specserve.model_executor.loader import resolve_dtype
    from specserve.model_executor.models.eagle import EagleConfig, is_eagle_folder, load_eagle_head
    from specserve.model_executor.models.eagle3 import Eagle3Config, is_eagle3_folder, load_eagle3_head

    folder = spec.model
    eagle3 = is_eagle3_folder(folder)
    if not eagle3 and not is_eagle_folder(folder):
        raise ValueError(
            f"speculative method 'eagle' needs an EAGLE head folder (with eagle_config.json), got {folder!r}; "
            "train one with `specserve train-draft --target MODEL --method eagle --out DIR`"
        )
    if ctx.tensor_parallel_size != 1 or ctx.target_embed_tokens is None:
        raise ValueError("the EAGLE proposer does not support tensor_parallel_size > 1 yet")
    if eagle3:       # the width of the target's features it reads, not its own
        config = Eagle3Config.load(folder, ctx.target_num_layers)
        width, what = config.target_hidden_size, "reads features of width"
    else:
        config = EagleConfig.load(folder)
        width, what = config.hidden_size, "has hidden size"
    check_vocab(ctx.target_vocab_size, config.vocab_size, folder)
    if width != ctx.target_hidden_size:
        raise ValueError(f"the EAGLE head {folder!r} {what} {width} but the target has {ctx.target_hidden_size}; "
                         f"it was trained for another target")
    weight_dtype = resolve_dtype(spec.draft_dtype, ctx.device) if spec.draft_dtype else ctx.dtype
    max_positions = ctx.max_model_len + spec.num_speculative_tokens
    dtype = compute_dtype_for(weight_dtype, ctx.device)
    head = (load_eagle3_head(folder, dtype, ctx.target_num_layers, max_positions=max_positions) if eagle3
            else load_eagle_head(folder, dtype, max_positions=max_positions))
    return EagleProposer(head, ctx.target_embed_tokens, ctx.target_lm_head_weight, ctx.kv_cache,
                         ctx.target_vocab_size, ctx.device, weight_dtype, ctx.block_size, spec.tree,
                         spec.num_speculative_tokens, graphs=ctx.graphs, max_num_seqs=ctx.max_num_seqs,
                         max_model_len=max_positions)


def target_feature_layers(spec, target_num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the proposer reads beside the final hidden state (an EAGLE-3
    head's; none for other proposers): set on the target before its CUDA graphs are captured."""
    from specserve.model_executor.models.eagle3 import Eagle3Config, is_eagle3_folder

    if spec is None or spec.method != "eagle" or not is_eagle3_folder(spec.model):
        return ()
    return Eagle3Config.load(spec.model, target_num_layers).feature_layers
