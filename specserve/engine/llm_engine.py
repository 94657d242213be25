"""The engine: add requests, step, abort. Orchestration only; the work is done elsewhere.

One step (``step``): the scheduler picks requests and token counts, with lookahead
slots for draft tokens (``core.scheduler``); the proposer drafts (``drafting``); the
target runs ONE forward over every request's new tokens (``step_inputs.forward_input``);
``sample.verify`` turns the logits and the drafts into each request's tokens; then per
request (``_update``) a tree's accepted branch has its K/V moved into place,
``Request.commit_step`` rolls the rejected drafts back (no KV block is freed), and the
tokens are appended with stop checks (``output_processor``).
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from specserve.beam_search_params import BeamSearchParams
from specserve.config import EngineConfig, SpeculativeConfig
from specserve.core.kv_cache_manager import PROPOSER_KV_FROM_FEATURES, KVCacheManager
from specserve.core.request import Request, RequestStatus, request_seed
from specserve.core.scheduler import ScheduledRequest, Scheduler
from specserve.distributed.launcher import WorkerError
from specserve.engine import input_checks
from specserve.engine.beam_groups import BeamGroups, beam_capable_proposer
from specserve.engine.constraints import Constraints
from specserve.engine.drafting import Drafting, calibrate_k_policy
from specserve.engine.embedding import check_pooling, embed_prompt
from specserve.engine.errors import StepFailedError
from specserve.engine.lora_adapters import LoraAdapters
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.prompt_logprobs import add_prompt_logprobs, prompt_rows
from specserve.engine.sample_group import SampleGroup, SampleGroups, child_id, child_params
from specserve.engine.start_up import (kv_cache_blocks, max_model_len_for, prefix_caching_allowed, proposer_context,
                                       resolve_device)
from specserve.engine.step_inputs import drafts_per_depth, forward_input, tree_branch_moves
from specserve.model_executor.layers.attention import cache_slot
from specserve.model_executor.generation_config import sampling_defaults
from specserve.lora.request import LoRAMix, LoRARequest
from specserve.model_executor.loader import keeps_quantized, load_model, resolve_dtype
from specserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, SpecDecodeStats
from specserve.sample.penalties import bad_words_token_ids
from specserve.sample.verify import Verifier
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.eagle import target_feature_layers
from specserve.spec_decode.factory import build_proposer, resolve_speculative_config
from specserve.spec_decode.k_policy import DraftLengthPolicy
from specserve.spec_decode.proposer import Proposer
from specserve.worker.model_runner import allocate_kv_cache
from specserve.worker.tp_executor import build_executor, prepare_parallelism

logger = logging.getLogger(__name__)

class LLMEngine:
    """``proposer``: a Proposer of the caller's own instead of one built from ``spec_config``
    (training's FeatureRecorder). Without a ``spec_config`` it gets no lookahead slots: it
    never drafts, but it observes the target's hidden states if it asks for them."""

    def __init__(self, config: EngineConfig, spec_config: SpeculativeConfig | None = None,
                 proposer: Proposer | None = None):
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
        self.model_name, self.tokenizer, self.hf_config = loaded.name, loaded.tokenizer, loaded.config
        # {SamplingParams field: value}: what requests that do not set a field get (the model's advice)
        self.sampling_defaults = sampling_defaults(loaded.source, config.generation_config,
                                                   config.override_generation_config)
        if self.sampling_defaults:
            logger.info("requests that leave a field out take the model's generation config: %s (generation_config "
                        "'vllm', --generation-config vllm, ignores it)", self.sampling_defaults)
        self.max_model_len = max_model_len_for(config, loaded.config)
        # A ModelRunner, or at tensor_parallel_size > 1 a TensorParallelExecutor with the same interface.
        self.runner = build_executor(config, loaded, self.dtype, self.device, self.max_model_len)
        self.device = self.runner.device  # cuda:LOCAL_RANK under tensor parallelism
        del loaded
        self.vocab_size = self.hf_config.vocab_size
        self.verifier = Verifier(self.vocab_size, self.device, self.tokenizer)
        # lookahead slots per decoding request: k for a chain; a draft tree's nodes or expansions
        self.num_speculative_tokens = k = spec_config.num_lookahead_slots if spec_config else 0
        num_blocks = kv_cache_blocks(config, self.runner.bytes_per_block, self.max_model_len, k)
        # an EAGLE-3 head reads the residual stream before some target layers too: set before graphs
        feature_layers = target_feature_layers(spec_config, self.hf_config.num_hidden_layers) \
            or tuple(getattr(proposer, "target_feature_layers", ()))      # a proposer passed in (training's recorder)
        if feature_layers:
            self.runner.set_feature_layers(feature_layers)
        # CUDA graphs for decode and verification steps (k + 1 rows; a tree's nodes + 1) on GPUs
        self.uses_graphs = allocate_kv_cache(self.runner, num_blocks, not config.enforce_eager, config.max_num_seqs,
                                             max_query_len=k + 1, max_tree_span=k + 1 if spec_config else 0)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size,
                                       enable_prefix_caching=prefix_caching_allowed(config, proposer))
        if proposer is None and spec_config is not None:
            ctx = proposer_context(config, self.runner, self.dtype, self.hf_config, self.max_model_len, self.kv_cache,
                                   self.tokenizer)
            proposer = build_proposer(spec_config, ctx)
        self.proposer = proposer
        if proposer is not None:   # its K/V in the target's blocks rides along with them
            self.kv_cache.set_proposer_kv(proposer.cached_kv)
        self.k_policy = DraftLengthPolicy(k) if spec_config is not None and spec_config.dynamic_k else None
        if self.k_policy is not None:
            calibrate_k_policy(self.k_policy, self.runner, getattr(self.proposer, "runner", None), k,
                               self.max_model_len, self.kv_cache.blocks_for)
        self.loras = LoraAdapters(self.runner, self.hf_config, config.max_lora_rank,
                                  config.max_cpu_loras or config.max_loras) if config.enable_lora else None
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, num_lookahead_slots=k,
            max_loras=config.max_loras if config.enable_lora else None,
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.groups = SampleGroups()                      # requests with n > 1
        self.spec_stats = SpecDecodeStats()
        self.beams = BeamGroups(self.kv_cache, self.scheduler, self.runner, self.proposer, self.tokenizer,
                                self.spec_stats)      # beam search requests
        self.drafting = Drafting(spec_config.disable_by_batch_size if spec_config else None, self.k_policy,
                                 self.spec_stats, self.max_model_len)
        self.request_errors: dict[str, BaseException] = {}   # finish_reason "error" -> why
        self._blocks_held: list[Request] = []    # finished this step; blocks freed at its end (_finish)
        self._ids = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.constraints = Constraints(self.tokenizer, self.vocab_size, self.eos_token_id,
                                       grammar_drafts=bool(spec_config and spec_config.grammar_drafts),
                                       disable_by_batch_size=spec_config.disable_by_batch_size if spec_config else None,
                                       overlap_masks=(self.device.type == "cuda" if config.overlap_grammar_masks is None
                                                      else config.overlap_grammar_masks))

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt gets the tokens its tokenizer adds (Gemma's and Llama's BOS), as in
        vLLM and llama.cpp; a rendered chat template already holds them (add_special_tokens=False)."""
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens) if prompt else []

    def prepare_prompt(self, prompt: str | list[int],
                       params: SamplingParams | None = None) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt (truncated as ``params`` asks: truncate_prompt_tokens);
        raises ValueError naming the problem."""
        truncate = getattr(params, "truncate_prompt_tokens", None)
        return input_checks.prepare_prompt(prompt, self.tokenize, self.vocab_size, self.max_model_len, truncate)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prepared: tuple[str | None, list[int]] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError before any work starts.

        ``prepared`` is ``prepare_prompt(prompt)``'s result when the caller already has it.
        Without ``params``: the model's defaults (``sampling_defaults``). ``priority``: lower
        runs first, with scheduling_policy "priority" only (``core.scheduler``). ``lora_request``:
        the LoRA adapter it runs with (``enable_lora``).
        """
        input_checks.check_priority(priority, self.config.scheduling_policy)
        params = params or SamplingParams(**self.sampling_defaults)
        text, token_ids = prepared if prepared is not None else self.prepare_prompt(prompt, params)
        input_checks.check_params(params, self.vocab_size)
        self.constraints.check(params)    # a schema, regex or grammar compiled (cached), or refused here
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests or request_id in self.groups or request_id in self.beams:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora_id = self._acquire_lora(lora_request)
        if params.n == 1:
            self.scheduler.add_request(self._new_request(request_id, text, token_ids, params, priority, lora_id))
            return request_id
        children = [self._new_request(child_id(request_id, i), text, token_ids, child_params(params, i), priority,
                                      lora_id)
                    for i in range(params.n)]
        group = SampleGroup(request_id, children, hold_siblings=self.kv_cache.enable_prefix_caching)
        self.groups.add(group)
        for c in children:
            if c not in group.held:
                self.scheduler.add_request(c)
        return request_id

    def add_beam_search(self, prompt: str | list[int], params: BeamSearchParams, request_id: str | None = None,
                        prepared: tuple[str | None, list[int]] | None = None,
                        lora_request: LoRARequest | None = None) -> str:
        """Queue a beam search (engine/beam_search.py); its one output comes when it is done."""
        text, token_ids = prepared if prepared is not None else self.prepare_prompt(prompt)
        beam_capable_proposer(self.proposer, params.beam_width, self.config.max_num_seqs,
                              self.config.max_num_batched_tokens, self.vocab_size)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests or request_id in self.groups or request_id in self.beams:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
        self.beams.add(request_id, text, token_ids, params, max_tokens, self.eos_token_id,
                       self._acquire_lora(lora_request))
        return request_id

    def _acquire_lora(self, lora_request: LoRARequest | LoRAMix | None) -> int:
        """The adapter's id (0 for none), loaded if it is not; ValueError if it cannot run."""
        if lora_request is None:
            return 0
        if self.loras is None:
            raise ValueError("LoRA adapters are not enabled: start the engine with enable_lora=True (--enable-lora)")
        if isinstance(lora_request, LoRAMix):
            return self.loras.acquire_mix(lora_request, self._loras_in_use())
        return self.loras.acquire(lora_request, self._loras_in_use())

    def _loras_in_use(self) -> set[int]:
        """The adapter ids unfinished requests hold (beams and held samples included)."""
        return ({r.lora_id for r in self.requests.values() if not r.is_finished()}
                | {r.lora_id for r in self.scheduler.running} | {r.lora_id for r in self.scheduler.waiting})

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter now (vLLM's), rather than at its first request; ValueError if it
        cannot run."""
        self._acquire_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded adapter (vLLM's); False if it is not loaded. One that unfinished requests
        use raises ValueError."""
        if self.loras is None:
            return False
        if lora_int_id in self._loras_in_use():
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by unfinished requests")
        return self.loras.remove(lora_int_id)

    def embed(self, prompt: str | list[int], pooling: str | None = None, normalize: bool = True,
              lora_request: LoRARequest | None = None,
              prepared: tuple[str | None, list[int]] | None = None) -> EmbeddingRequestOutput:
        """The prompt's embedding, computed now, between steps (``engine/embedding.py``); ValueError for
        bad input, ``EmbeddingNoRoomError`` while running requests hold the KV blocks it needs."""
        text, token_ids = prepared if prepared is not None else self.prepare_prompt(prompt)
        pooling = check_pooling(pooling or self.config.pooling)
        request_id = f"embd-{next(self._ids)}"
        vector = embed_prompt(self.runner, self.kv_cache, request_id, token_ids, pooling, normalize,
                              self.config.max_num_batched_tokens, self._acquire_lora(lora_request))
        return EmbeddingRequestOutput(request_id, text, token_ids, EmbeddingOutput(vector.tolist()))

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters (vLLM's)."""
        return set(self.loras.loaded) if self.loras is not None else set()

    def _new_request(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                     priority: int = 0, lora_id: int = 0) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, text, token_ids, params, request_seed(params, self._seed_rng), self.eos_token_id)
        req.priority = priority
        req.lora_id = lora_id
        req.bad_words_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        self.requests[request_id] = req
        self.constraints.attach(req)
        return req

    def abort_request(self, request_id: str) -> None:
        if request_id in self.beams:
            self.beams.abort(request_id)
            return
        group = self.groups.pop(request_id)
        if group is not None:
            for c in group.children:
                self.abort_request(c.request_id)
            group.held.clear()
            return
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished():
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.groups.has_held()

    def get_prefix_cache_stats(self) -> dict:
        """Prefix cache lookups since start-up, in tokens (vLLM's queries and hits)."""
        return self.kv_cache.prefix_cache_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, as vLLM's ``reset_prefix_cache``: only while no request
        is unfinished (their blocks' bookkeeping would go with it); False, and nothing done, otherwise."""
        if self.has_unfinished_requests():
            return False
        self.kv_cache.reset_prefix_cache()
        return True

    # ---------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self, stream_outputs: bool = True) -> list[RequestOutput]:
        """One step. Failures are isolated: an exception in one request's
        sampling or output handling finishes that request alone with finish_reason
        "error" (its exception: ``take_request_error``); a failed proposer means no
        drafts this step; only a failed target forward, which every scheduled request
        shares, raises ``StepFailedError`` naming the requests it hit.

        ``stream_outputs`` False: only finished requests' outputs are built and returned
        (``LLM.generate`` reads no other), saving every other request's detokenization and
        RequestOutput (1.6 ms a step at batch 64 on a CPU); streams keep the default."""
        step_started = time.perf_counter()
        self._free_held_blocks()     # (none: a step that ended early, by an exception, may leave some)
        for req in self.groups.take_released():
            self.scheduler.add_request(req)
        plan = self.scheduler.schedule()
        self._copy_cached_blocks()
        if not plan.scheduled:
            return []
        reserved = [s.num_lookahead for s in plan.scheduled]   # room for the grammar's forced drafts
        self.drafting.propose_or_skip(self.proposer, plan.scheduled)
        self.constraints.prepare(plan.scheduled, reserved)      # drafts cut to the grammar, masks
        inputs = [forward_input(s, self.kv_cache.block_table(s.request.request_id)) for s in plan.scheduled]
        # EAGLE-style proposers also see the target's hidden state of every kept position.
        want_hidden = self.proposer is not None and self.proposer.needs_target_hidden
        starts = [s.request.num_computed_tokens for s in plan.scheduled]
        started = time.perf_counter()
        try:
            result = self.runner.execute(inputs, return_all_hidden=True) if want_hidden else self.runner.execute(inputs)
        except WorkerError:   # a tensor-parallel rank died: the whole engine is gone, not this step
            raise
        except Exception as e:
            hit = dict.fromkeys(self.beams.public_id(self.groups.public_id(s.request.request_id))
                                for s in plan.scheduled)
            raise StepFailedError(list(hit), e) from e
        finally:
            self.constraints.wait_masks()   # the grammar's rows, computed while the forward ran
        sampling = [s for s in plan.scheduled if s.will_sample]
        logits, prompt_logits = self._split_prompt_rows(plan.scheduled, inputs, starts, result.logits)
        beam_rows = {}
        if self.beams:    # beam search requests' rows go to their search, not to the verifier
            sampling, logits, beam_rows = self.beams.split(sampling, [len(s.request.draft_token_ids) + 1
                                                                      for s in sampling], logits)
        emitted = self.verifier.verify_isolated([s.request for s in sampling], logits) if sampling else {}
        verified_at = time.perf_counter()   # the logits are on the host now
        outputs = []
        for s in plan.scheduled:
            if s.request.request_id in beam_rows:
                continue
            try:
                out = self._update(s, emitted, prompt_logits, stream_outputs)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                out = self._fail_request(s.request, e)
            if out is not None:
                outputs.append(out)
        outputs = self.groups.merge_outputs(outputs, self.abort_request, self.request_errors)
        if beam_rows:
            outputs += self.beams.advance(beam_rows, self.request_errors)
        self.drafting.score_proposals(plan.scheduled)
        self.drafting.record_step_costs(plan.scheduled, inputs, step_started, started, verified_at)
        if want_hidden:
            self.drafting.show_hidden_states(self.proposer, plan.scheduled, inputs, starts, result.all_hidden)
        if self.kv_cache.proposer_kv == PROPOSER_KV_FROM_FEATURES:
            self._share_blocks_the_head_completed(plan.scheduled)
        return outputs

    @staticmethod
    def _split_prompt_rows(scheduled: list[ScheduledRequest], inputs: list, starts: list[int],
                           logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step's logits [sum num_logits, V] -> (the sampling rows, in request order, and
        {request id: [count, V] prompt rows} of the requests collecting prompt logprobs)."""
        if not any(s.request.needs_prompt_logprobs for s in scheduled):   # the usual step: nothing to set aside
            return logits, {}
        prompt_logits, keep, row, leads = {}, [], 0, False
        for s, inp, start in zip(scheduled, inputs, starts):
            lead, count = prompt_rows(s.request, start, s.num_new_tokens, s.will_sample)
            if count:
                prompt_logits[s.request.request_id] = logits[row : row + count]
            leads = leads or lead > 0
            keep.extend(range(row + lead, row + inp.num_logits))
            row += inp.num_logits
        if not leads:
            return logits, prompt_logits
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)], prompt_logits

    def _share_blocks_the_head_completed(self, scheduled: list[ScheduledRequest]) -> None:
        """EAGLE (its K/V "from_features"): in ``observe`` its head computed the positions of this
        step's prefills and of the requests that finished in it; their full blocks are registered
        now, then the finished requests' blocks (held for this, ``_finish``) are freed."""
        for s in scheduled:
            req = s.request
            if (req.status is RequestStatus.RUNNING and req.request_id in self.requests) or req in self._blocks_held:
                self.kv_cache.cache_request_blocks(req, min(req.num_computed_tokens, req.num_tokens))
        self._free_held_blocks()

    def _free_held_blocks(self) -> None:
        for req in self._blocks_held:
            self.kv_cache.free(req.request_id)
        self._blocks_held.clear()

    def _copy_cached_blocks(self) -> None:
        """The slots prefix cache hits need copied (EAGLE's last hit block, core/kv_cache_manager.py),
        in the target's cache and the proposer's, before the step computes anything."""
        src, dst = self.kv_cache.take_pending_copies()
        if src:
            self.runner.copy_kv_slots(src, dst)
            if self.proposer is not None:
                self.proposer.copy_kv_slots(src, dst)

    def _update(self, s: ScheduledRequest, emitted: dict, prompt_logits: dict,
                stream_outputs: bool = True) -> RequestOutput | None:
        """Advance one scheduled request by its prompt logprobs (``prompt_logits``) and emitted
        tokens (stop checks one by one) -> its output; without ``stream_outputs`` only a finished
        request's (``step``)."""
        req = s.request
        if req.request_id in prompt_logits:
            add_prompt_logprobs(req, prompt_logits[req.request_id], self.tokenizer)
        if not s.will_sample:   # a prefill chunk short of the prompt's end
            req.commit_step(s.num_new_tokens, None)
            self.kv_cache.cache_request_blocks(req, req.num_computed_tokens)
            return None
        verified = emitted[req.request_id]
        if isinstance(verified, BaseException):
            raise verified
        num_drafts = len(req.draft_token_ids)
        per_depth = None if req.draft_parents is None else drafts_per_depth(req.draft_parents)
        if verified.tree_path is not None:
            self._keep_tree_branch(req, verified.tree_path, last=req.num_computed_tokens + s.num_new_tokens - 1)
        req.commit_step(s.num_new_tokens, verified.num_accepted)
        status, appended = self.output_processor.append_verified(req, verified)
        status = self.constraints.after_append(req, verified.token_ids[:appended], status)
        # Every token below num_computed_tokens is now verified and appended (a stop may
        # have cut the accepted drafts short): their full blocks may be shared.
        self.kv_cache.cache_request_blocks(req, min(req.num_computed_tokens, req.num_tokens))
        if s.num_new_tokens == 1:  # a decoding (verification) step, drafts or not
            req.spec_stats.record(num_drafts, verified.num_accepted, appended, per_depth)
            self.spec_stats.record(num_drafts, verified.num_accepted, appended, per_depth)
            if self.loras is not None:    # dynamic_k's per-adapter priors (engine/drafting.py)
                self.drafting.record_adapter_step(req.lora_id, num_drafts, verified.num_accepted, appended, per_depth)
        if status is not None:
            self._finish(req, status, hold_blocks=self.kv_cache.proposer_kv == PROPOSER_KV_FROM_FEATURES)
        if not (stream_outputs or req.is_finished()):
            return None
        return self.output_processor.make_output(req)

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

    def _finish(self, req: Request, status: RequestStatus, hold_blocks: bool = False) -> None:
        """``hold_blocks``: its blocks are freed at the end of the step (EAGLE's head computes its
        last positions first, so they can be shared: ``_share_blocks_the_head_completed``)."""
        req.finish_time = time.monotonic()
        self.scheduler.finish(req, status, free_blocks=not hold_blocks)
        if hold_blocks:
            self._blocks_held.append(req)
        self.requests.pop(req.request_id, None)

    def _keep_tree_branch(self, req: Request, path: list[int], last: int) -> None:
        """Copy the K/V of the accepted branch's drafts down to the slots of their positions
        (the target's here, a proposer's own cache in its ``keep_tree_branch``)."""
        if self.proposer is not None:
            self.proposer.keep_tree_branch(req, path, last)
        moves = tree_branch_moves(path, last)
        if moves:
            table, bs = self.kv_cache.block_table(req.request_id), self.config.block_size
            self.runner.copy_kv_slots([cache_slot(table, src, bs) for src, _ in moves],
                                      [cache_slot(table, dst, bs) for _, dst in moves])

    def get_spec_decode_stats(self) -> SpecDecodeStats:
        return self.spec_stats
