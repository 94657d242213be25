"""The engine: add requests, step, abort.

One step: the scheduler picks requests and token counts (with lookahead slots
for draft tokens), the proposer drafts, the target runs ONE forward over every
request's new tokens, the rejection sampler accepts/recovers/adds a bonus, and
the tokens are appended with stop checks. ``num_computed_tokens`` is lowered by
the number of rejected draft tokens; no KV block is freed. (A tree of drafts is
walked by ``sample.tree_sampler`` instead, and the accepted branch's K/V, when
it was not the first branch laid out, is copied down to the slots its positions
use.)
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from specserve.config import EngineConfig, SpeculativeConfig
from specserve.distributed.launcher import WorkerError
from specserve.engine.drafting import Drafting, calibrate_k_policy
from specserve.core.kv_cache_manager import KVCacheManager
from specserve.engine.output_processor import OutputProcessor
from specserve.core.request import Request, RequestStatus
from specserve.engine.sample_group import SampleGroup, child_id, child_params
from specserve.core.scheduler import ScheduledRequest, Scheduler
from specserve.model_executor.layers.attention import cache_slot, tree_layout
from specserve.model_executor.loader import keeps_quantized, load_model, resolve_dtype
from specserve.outputs import RequestOutput, SpecDecodeStats
from specserve.sample.verify import Verifier
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.factory import build_proposer, resolve_speculative_config
from specserve.spec_decode.k_policy import DraftLengthPolicy
from specserve.spec_decode.proposer import kept_hidden_states
from specserve.worker.model_runner import ForwardInput
from specserve.worker.tp_executor import build_executor, prepare_parallelism

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


class StepFailedError(RuntimeError):
    """The part of a step every scheduled request shares (the target forward) failed.

    ``request_ids`` are the requests of that step; requests not scheduled in it are untouched.
    """

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"the engine step over {len(request_ids)} request(s) failed: {type(cause).__name__}: {cause}")
        self.request_ids = list(request_ids)
        self.cause = cause


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, config: EngineConfig, spec_config: SpeculativeConfig | None = None):
        self.config = config
        if spec_config is not None:
            spec_config = resolve_speculative_config(spec_config, config.model)
        self.spec_config = spec_config
        prepare_parallelism(config, spec_config)  # TP checks; on a torchrun worker rank this serves and exits
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # GGUF blocks as they are on a CPU
        loaded = load_model(config.model, self.dtype, keep_quantized=keeps_quantized(config.dtype, self.device),
                            int8_activations=config.int8_activations)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.config
        model_limit = getattr(loaded.config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of {model_limit} positions")
        self.max_model_len = config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
        # A ModelRunner, or at tensor_parallel_size > 1 a TensorParallelExecutor with the same interface.
        self.runner = build_executor(config, loaded, self.dtype, self.device, self.max_model_len)
        self.device = self.runner.device  # cuda:LOCAL_RANK under tensor parallelism
        del loaded
        self.vocab_size = loaded_vocab = self.hf_config.vocab_size
        self.verifier = Verifier(self.vocab_size, self.device, self.tokenizer)
        k = spec_config.num_speculative_tokens if spec_config else 0
        num_blocks = config.kv_cache_memory // self.runner.bytes_per_block
        needed = -(-(self.max_model_len + k) // config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory} bytes holds {num_blocks} blocks of {config.block_size} "
                f"tokens, fewer than one request of max_model_len={self.max_model_len} (+{k} lookahead) needs "
                f"({needed}); raise kv_cache_memory or lower max_model_len"
            )
        self.runner.allocate_kv_cache(num_blocks)
        prefix_caching = config.enable_prefix_caching
        if prefix_caching and spec_config is not None and spec_config.method == "eagle":
            logger.info("prefix caching is off with EAGLE: its drafts need the target's hidden state at every position")
            prefix_caching = False
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=prefix_caching)
        self.proposer = build_proposer(spec_config, self, loaded_vocab) if spec_config else None
        self.num_speculative_tokens = k
        self.k_policy = DraftLengthPolicy(k) if spec_config is not None and spec_config.dynamic_k else None
        if self.k_policy is not None:
            calibrate_k_policy(self.k_policy, self.runner, getattr(self.proposer, "runner", None), k,
                               self.max_model_len, self.kv_cache.blocks_for)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, num_lookahead_slots=k
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, SampleGroup] = {}          # requests with n > 1, by their id
        self._group_of: dict[str, SampleGroup] = {}       # ... and by their children's ids
        self.spec_stats = SpecDecodeStats()
        self.drafting = Drafting(spec_config.disable_by_batch_size if spec_config else None, self.k_policy,
                                 self.spec_stats)
        self.request_errors: dict[str, BaseException] = {}   # finish_reason "error" -> why
        self._ids = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self.eos_token_id = self.tokenizer.eos_token_id

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []

    def prepare_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt; raises ValueError naming the problem."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in token_ids if not (0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens long, but max_model_len is {self.max_model_len} "
                "(at least one token must fit after it)"
            )
        return text, token_ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prepared: tuple[str | None, list[int]] | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError before any work starts.

        ``prepared`` is ``prepare_prompt(prompt)``'s result when the caller already has it.
        """
        params = params or SamplingParams()
        text, token_ids = prepared if prepared is not None else self.prepare_prompt(prompt)
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests or request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            self.scheduler.add_request(self._new_request(request_id, text, token_ids, params))
            return request_id
        children = [self._new_request(child_id(request_id, i), text, token_ids, child_params(params, i))
                    for i in range(params.n)]
        group = SampleGroup(request_id, children, hold_siblings=self.kv_cache.enable_prefix_caching)
        self.groups[request_id] = group
        for c in children:
            self._group_of[c.request_id] = group
            if c not in group.held:
                self.scheduler.add_request(c)
        return request_id

    def _new_request(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            generator = torch.Generator(device=self.device).manual_seed(seed)
        req = Request(request_id, text, token_ids, params, generator, self.eos_token_id)
        self.requests[request_id] = req
        return req

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is not None:
            for c in group.children:
                self._group_of.pop(c.request_id, None)
                self.abort_request(c.request_id)
            group.held.clear()
            return
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished():
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or any(g.held for g in self.groups.values())

    def get_prefix_cache_stats(self) -> dict:
        """Prefix cache lookups since start-up, in tokens (vLLM's queries and hits)."""
        kv = self.kv_cache
        return {
            "enabled": kv.enable_prefix_caching,
            "queries": kv.num_queried_tokens,
            "hits": kv.num_hit_tokens,
            "hit_rate": kv.num_hit_tokens / kv.num_queried_tokens if kv.num_queried_tokens else 0.0,
        }

    # ---------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step. Failures are isolated (issue 19): an exception in one request's
        sampling or output handling finishes that request alone with finish_reason
        "error" (its exception: ``take_request_error``); a failed proposer means no
        drafts this step; only a failed target forward, which every scheduled request
        shares, raises ``StepFailedError`` naming the requests it hit."""
        step_started = time.perf_counter()
        self._release_held_samples()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        self.drafting.propose_or_skip(self.proposer, plan.scheduled)
        inputs = [self._forward_input(s) for s in plan.scheduled]
        # EAGLE-style proposers also see the target's hidden state of every kept position.
        want_hidden = self.proposer is not None and self.proposer.needs_target_hidden
        starts = [s.request.num_computed_tokens for s in plan.scheduled]
        started = time.perf_counter()
        try:
            result = self.runner.execute(inputs, return_all_hidden=True) if want_hidden else self.runner.execute(inputs)
        except WorkerError:   # a tensor-parallel rank died: the whole engine is gone, not this step
            raise
        except Exception as e:
            hit = dict.fromkeys(self._public_id(s.request.request_id) for s in plan.scheduled)
            raise StepFailedError(list(hit), e) from e
        sampling = [s for s in plan.scheduled if s.will_sample]
        emitted = self.verifier.verify_isolated([s.request for s in sampling], result.logits) if sampling else {}
        decode_step = self.k_policy is not None and all(s.num_new_tokens == 1 for s in plan.scheduled)
        if decode_step:   # a verification step's cost (its logits are on the host now)
            forward_seconds = time.perf_counter() - started
            self.k_policy.record_forward(sum(len(i.token_ids) for i in inputs), forward_seconds)
        outputs = []
        for s in plan.scheduled:
            try:
                out = self._update(s, emitted)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                out = self._fail_request(s.request, e)
            if out is not None:
                outputs.append(out)
        outputs = self._group_outputs(outputs)
        if decode_step:   # what the step spent besides the forward and the proposer
            self.k_policy.record_overhead(time.perf_counter() - step_started - forward_seconds - self.drafting.propose_seconds)
        if want_hidden:
            sizes = [len(i.token_ids) for i in inputs]
            try:
                self.proposer.observe(kept_hidden_states(plan.scheduled, sizes, starts, result.all_hidden))
            except Exception:  # noqa: BLE001 - stale proposer state only costs acceptance
                logger.exception("the proposer failed to observe the target's hidden states")
        return outputs

    def _update(self, s: ScheduledRequest, emitted: dict) -> RequestOutput | None:
        """Advance one scheduled request by its emitted tokens (stop checks one by one)."""
        req = s.request
        if not s.will_sample:   # a prefill chunk short of the prompt's end
            req.commit_step(s.num_new_tokens, None)
            self.kv_cache.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            return None
        verified = emitted[req.request_id]
        if isinstance(verified, BaseException):
            raise verified
        num_drafts = len(req.draft_token_ids)
        per_depth = None if req.draft_parents is None else _drafts_per_depth(req.draft_parents)
        if verified.tree_path is not None:
            self._keep_tree_branch(req, verified.tree_path, last=req.num_computed_tokens + s.num_new_tokens - 1)
        req.commit_step(s.num_new_tokens, verified.num_accepted)
        status, appended = None, 0
        for i, token in enumerate(verified.token_ids):
            if req.logprobs is not None:
                req.logprobs.append(verified.logprobs[i])
            appended += 1
            req.token_sources.append(verified.sources[i])
            status = self.output_processor.append(req, token)
            if status is not None:
                break
        # Every token below num_computed_tokens is now verified and appended (a stop may
        # have cut the accepted drafts short): their full blocks may be shared.
        self.kv_cache.cache_full_blocks(req.request_id, req.all_token_ids, min(req.num_computed_tokens, req.num_tokens))
        if s.num_new_tokens == 1:  # a decoding (verification) step, drafts or not
            req.spec_stats.record(num_drafts, verified.num_accepted, appended, per_depth)
            self.spec_stats.record(num_drafts, verified.num_accepted, appended, per_depth)
        if status is not None:
            self._finish(req, status)
        return self.output_processor.make_output(req)

    def _public_id(self, request_id: str) -> str:
        group = self._group_of.get(request_id)
        return group.request_id if group is not None else request_id

    def _release_held_samples(self) -> None:
        """Samples 2..n of a request start once sample 1 has computed the shared prompt."""
        for group in self.groups.values():
            if group.ready_to_release():
                for c in group.held:
                    self.scheduler.add_request(c)
                group.held.clear()

    def _group_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs -> one output per request with n > 1 (the others pass through).

        A child that failed fails its whole request: its siblings are aborted and the
        error is filed under the request's own id."""
        merged: dict[str, RequestOutput] = {}
        passthrough = []
        for out in outputs:
            group = self._group_of.get(out.request_id)
            if group is None:
                passthrough.append(out)
                continue
            if out.outputs[0].finish_reason == "error":
                self.request_errors[group.request_id] = self.request_errors.pop(out.request_id, None)
                for c in group.children:
                    if c.request_id != out.request_id:
                        self.abort_request(c.request_id)
                group.held.clear()
            merged[group.request_id] = group.merge(out)
        for rid, out in merged.items():
            if out.finished or any(o.finish_reason == "error" for o in out.outputs):
                group = self.groups.pop(rid, None)
                for c in group.children if group else []:
                    self._group_of.pop(c.request_id, None)
        return passthrough + list(merged.values())

    def _fail_request(self, req: Request, error: BaseException) -> RequestOutput:
        """Finish one request because of its own failure; the rest of the batch carries on."""
        logger.error("request %s failed: %s: %s", req.request_id, type(error).__name__, error, exc_info=error)
        self.request_errors[req.request_id] = error
        if len(self.request_errors) > 1024:  # nobody collects them (the LLM facade): keep the newest
            self.request_errors.pop(next(iter(self.request_errors)))
        req.clear_drafts()
        if not req.is_finished():
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.make_output(req, error=error)

    def take_request_error(self, request_id: str) -> BaseException | None:
        """The exception that finished a request with finish_reason "error" (once)."""
        return self.request_errors.pop(request_id, None)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.finish_time = time.monotonic()
        self.scheduler.finish(req, status)
        self.requests.pop(req.request_id, None)

    def _forward_input(self, s: ScheduledRequest) -> ForwardInput:
        req = s.request
        start = req.num_computed_tokens
        n = s.num_new_tokens
        tokens = req.all_token_ids[start : start + n] + req.draft_token_ids
        tree_parents = None
        if req.draft_parents is not None:  # new tokens in a chain, then drafts under the last one
            tree_parents = list(range(-1, n - 1)) + [p + n if p >= 0 else n - 1 for p in req.draft_parents]
        return ForwardInput(
            token_ids=tokens,
            start_position=start,
            block_table=self.kv_cache.block_table(req.request_id),
            num_logits=len(req.draft_token_ids) + 1 if s.will_sample else 0,
            tree_parents=tree_parents,
        )

    def _keep_tree_branch(self, req: Request, path: list[int], last: int) -> None:
        """Copy the K/V of the accepted branch's drafts down to the slots of their positions.

        Draft i was computed in slot last + 1 + i (``last``: the position of the request's
        last token); the token accepted at depth d belongs at last + d. Drafts that
        already sit there (the first branch, as laid out) are not copied.
        """
        moves = [(last + 1 + node, last + depth) for depth, node in enumerate(path, 1) if node != depth - 1]
        if not moves:
            return
        table, bs = self.kv_cache.block_table(req.request_id), self.config.block_size
        self.runner.copy_kv_slots([cache_slot(table, src, bs) for src, _ in moves],
                                  [cache_slot(table, dst, bs) for _, dst in moves])

    # ------------------------------------------------------------------ helpers
    def get_spec_decode_stats(self) -> SpecDecodeStats:
        return self.spec_stats


def _drafts_per_depth(parents: list[int]) -> list[int]:
    """[number of draft tokens at position 1, 2, ...] of a tree of drafts."""
    depths, _ = tree_layout(parents)       # 0 for the last token's children
    counts = [0] * (max(depths, default=-1) + 1)
    for d in depths:
        counts[d] += 1
    return counts
