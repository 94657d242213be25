"""The ``LLM`` facade: vLLM's offline interface over specserve's engine."""
from __future__ import annotations

import logging

from typing import Sequence

from tqdm.auto import tqdm

from specserve.beam_search_params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from specserve.config import EngineConfig, SpeculativeConfig
from specserve.engine.async_engine import running_driver
from specserve.engine.embedding import EmbeddingNoRoomError
from specserve.engine.input_checks import check_priority
from specserve.engine.llm_engine import LLMEngine
from specserve.entrypoints.chat_template import load_chat_template, render_chat
from specserve.lora.request import LoRARequest
from specserve.outputs import EmbeddingRequestOutput, RequestOutput, SpecDecodeStats
from specserve.sampling_params import SamplingParams

Prompt = str | list[int]

logger = logging.getLogger(__name__)


def build_speculative_config(
    speculative_model: str | None,
    num_speculative_tokens: int | None,
    speculative_config: dict | SpeculativeConfig | None,
    speculative_method: str | None = None,
    draft_tensor_parallel_size: int | None = None,
) -> SpeculativeConfig | None:
    """Merge the flat keyword arguments and the dict form into one config."""
    if isinstance(speculative_config, SpeculativeConfig):
        if draft_tensor_parallel_size is not None:
            speculative_config.draft_tensor_parallel_size = draft_tensor_parallel_size
        return speculative_config
    values = dict(speculative_config or {})
    if draft_tensor_parallel_size is not None:
        values["draft_tensor_parallel_size"] = draft_tensor_parallel_size
    if speculative_model is not None:
        values["model"] = speculative_model
    if speculative_method is not None:
        values["method"] = speculative_method
    if num_speculative_tokens is not None:
        values["num_speculative_tokens"] = num_speculative_tokens
    if not values:
        return None
    if "method" not in values and "model" not in values:
        raise ValueError("speculative decoding needs a speculative model or a method (e.g. 'ngram')")
    return SpeculativeConfig.from_dict(values)


def _draft_tp_from_vllm_spellings(uses_tp_1: bool | None, draft_tp: int | None, target_tp: int) -> int | None:
    """The draft's TP size from vLLM's two keyword spellings (None: neither given)."""
    from_flag = None if uses_tp_1 is None else (1 if uses_tp_1 else target_tp)
    if from_flag is not None and draft_tp is not None and from_flag != draft_tp:
        raise ValueError(f"speculative_model_uses_tp_1={uses_tp_1} and speculative_draft_tensor_parallel_size="
                         f"{draft_tp} disagree; give one of them")
    return draft_tp if draft_tp is not None else from_flag


class LLM:
    """Generate text with a target model, optionally with lossless speculative decoding.

    >>> llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    >>> llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))

    ``proposer`` (specserve's own): a ``spec_decode.proposer.Proposer`` object used instead
    of one built from the speculative settings; without those it never drafts but may
    observe the target's hidden states (training's recorder does).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_memory: int = 1 << 30,
        gpu_memory_utilization: float | None = None,
        seed: int = 0,
        tokenizer: str | None = None,
        speculative_model: str | None = None,
        num_speculative_tokens: int | None = None,
        speculative_config: dict | SpeculativeConfig | None = None,
        tensor_parallel_size: int = 1,
        device: str | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        int8_activations: bool | int = False,
        enforce_eager: bool = False,
        generation_config: str = "auto",
        override_generation_config: dict | None = None,
        scheduling_policy: str = "fcfs",
        pooling: str = "last",
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        trust_remote_code: bool = False,
        proposer=None,
        speculative_model_uses_tp_1: bool | None = None,
        speculative_draft_tensor_parallel_size: int | None = None,
    ):
        """``speculative_model_uses_tp_1`` (vLLM's original draft-model spelling) and
        ``speculative_draft_tensor_parallel_size`` (its later one) set the speculative config's
        ``draft_tensor_parallel_size``: the draft at TP 1 while the target runs at TP N.
        ``trust_remote_code`` is accepted as vLLM's ``LLM`` takes it and changes nothing:
        specserve runs its own model code, never code from a model's folder.
        ``gpu_memory_utilization`` (vLLM's memory budget, in (0, 1]) is accepted so vLLM's scripts
        run, and is not applied: the KV cache is ``kv_cache_memory`` bytes; a warning says so. So is
        ``tokenizer`` (vLLM's GGUF recipe names the model's Hugging Face tokenizer): specserve reads
        the tokenizer from the model, a GGUF file's own included."""
        if gpu_memory_utilization is not None:
            if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
                    or not 0 < gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
            logger.warning("gpu_memory_utilization=%s is not applied: specserve sizes the KV cache by "
                           "kv_cache_memory (%d bytes)", gpu_memory_utilization, kv_cache_memory)
        if tokenizer is not None:     # vLLM's GGUF recipe names the Hugging Face tokenizer
            logger.warning("tokenizer=%r is not used: specserve reads the tokenizer from the model (a GGUF "
                           "file's own included)", tokenizer)
        draft_tp = _draft_tp_from_vllm_spellings(speculative_model_uses_tp_1, speculative_draft_tensor_parallel_size,
                                                 tensor_parallel_size)
        spec = build_speculative_config(speculative_model, num_speculative_tokens, speculative_config,
                                        draft_tensor_parallel_size=draft_tp)
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            int8_activations=int8_activations,
            enforce_eager=enforce_eager,
            generation_config=generation_config,
            override_generation_config=override_generation_config,
            scheduling_policy=scheduling_policy,
            pooling=pooling,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
        )
        self.engine = LLMEngine(config, spec, proposer=proposer)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended defaults (its generation config; vLLM's),
        what ``generate`` and ``chat`` use when given none."""
        return SamplingParams(**self.engine.sampling_defaults)

    def get_spec_decode_stats(self) -> SpecDecodeStats:
        """Engine-wide speculation counts since start-up."""
        return self.engine.get_spec_decode_stats()

    def get_prefix_cache_stats(self) -> dict:
        """Prefix cache lookups since start-up, in prompt tokens: queries, hits, hit_rate."""
        return self.engine.get_prefix_cache_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's; False, and nothing done, while requests run)."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings, token-id lists, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``) to completion; outputs keep input order.

        Every prompt is validated before any work starts, so one bad prompt raises
        without running (or losing) the others. ``priority``: one per prompt (lower first), with
        ``scheduling_policy="priority"`` (vLLM's). ``lora_request``: the LoRA adapter of every
        prompt, or one per prompt (None: the base model), with ``enable_lora=True``.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        for p in priorities:
            check_priority(p, self.engine.config.scheduling_policy)
        loras = self._lora_per_prompt(lora_request, len(prompts))
        prepared = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                p = _unwrap_prompt(p)
                prepared.append((p, self.engine.prepare_prompt(p, sp)))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = []
        try:
            for (p, pp), sp, prio, lora in zip(prepared, params, priorities, loras):
                ids.append(self.engine.add_request(p, sp, prepared=pp, priority=prio, lora_request=lora))
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) > 8)

    def _prepare_all(self, prompts) -> list[tuple]:
        """One prompt or a list of them -> (prompt, ``prepare_prompt``'s result) each; ValueError naming the
        first bad prompt before any is queued."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prepared = []
        for i, p in enumerate(prompts):
            try:
                p = _unwrap_prompt(p)
                prepared.append((p, self.engine.prepare_prompt(p)))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return prepared

    def _check_not_driven(self) -> None:
        if running_driver(self.engine) is not None:   # two threads stepping one engine would corrupt it
            raise RuntimeError("an AsyncLLMEngine (for example a running server) is driving this LLM's engine; "
                               "send requests through it, or shut it down first")

    def _lora_per_prompt(self, lora_request, count: int) -> list:
        """One LoRARequest (or None) per prompt, every adapter loaded and checked (ValueError) before
        any prompt is queued."""
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        if len(loras) != count:
            raise ValueError(f"got {count} prompts but {len(loras)} LoRA requests")
        for lora in {id(x): x for x in loras if x is not None}.values():
            self.engine.add_lora(lora)
        return loras

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None, normalize: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's ``LLM.embed``: ``outputs.embedding``): its final hidden states
        pooled (``pooling``: "last", "mean" or "cls"; default the engine's ``pooling``) and, unless
        ``normalize`` is False, of unit length. Every prompt is checked before any is run."""
        prepared = self._prepare_all(prompts)
        loras = self._lora_per_prompt(lora_request, len(prepared))
        self._check_not_driven()
        try:
            return [self.engine.embed(p, pooling, normalize, lora, prepared=pp) for (p, pp), lora in zip(prepared, loras)]
        except EmbeddingNoRoomError as e:      # nothing else runs here: the cache is too small for the prompt
            raise ValueError(f"{e}: raise kv_cache_memory") from None

    def beam_search(
        self,
        prompts: Sequence[Prompt | dict],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's signature): per prompt, the ``beam_width`` best finished beams, best
        first. Prompts are strings, token-id lists, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``. With speculation the beams and their scores are the same as
        without (engine/beam_search.py says how); every prompt is checked before any work starts."""
        prepared = self._prepare_all(prompts)
        loras = self._lora_per_prompt(lora_request, len(prepared))
        ids = []
        try:
            for (p, pp), lora in zip(prepared, loras):
                ids.append(self.engine.add_beam_search(p, params, prepared=pp, lora_request=lora))
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        outputs = self._run(ids, use_tqdm)
        return [beam_search_output(out, params.length_penalty) for out in outputs]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``: a file or the Jinja text) to one
        conversation or a list of them (``chat_template`` module: continue_final_message,
        chat_template_kwargs, as in vLLM). ``tools`` (OpenAI's function definitions) go to a
        template that takes them; the answer's text is returned as generated, as vLLM's is."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = self._load_template(chat_template)   # once for every conversation
        prompts = [self._chat_prompt(c, add_generation_prompt, continue_final_message, chat_template_kwargs,
                                     template, tools)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                            chat_template: str | None = None, tools: list[dict] | None = None) -> list[int]:
        """The conversation's prompt token ids (ValueError where the template cannot take it)."""
        return self._chat_prompt(conversation, add_generation_prompt, continue_final_message, chat_template_kwargs,
                                 self._load_template(chat_template), tools)

    def _load_template(self, chat_template: str | None) -> str | None:
        return None if chat_template is None else load_chat_template(self.engine.tokenizer, chat_template)

    def _chat_prompt(self, conversation: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                     chat_template_kwargs: dict | None, template: str | None, tools: list[dict] | None) -> list[int]:
        """``apply_chat_template`` with the template already loaded (None: the model's)."""
        text = render_chat(self.engine.tokenizer, conversation, add_generation_prompt, continue_final_message,
                           tools=tools, template_kwargs=chat_template_kwargs, model_name=self.engine.model_name,
                           template=template)
        return self.engine.tokenize(text, add_special_tokens=False)   # the template wrote the special tokens

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        try:
            self._check_not_driven()
        except RuntimeError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Generating", disable=not show_progress)
        try:
            while wanted - finished.keys():
                for out in self.engine.step(stream_outputs=False):   # only finished outputs are read here
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in wanted - finished.keys():
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def beam_search_output(out: RequestOutput, length_penalty: float) -> BeamSearchOutput:
    """The engine's output of a beam search -> vLLM's shape (``tokens``: the prompt's, then the beam's)."""
    if any(c.finish_reason == "error" for c in out.outputs):
        raise RuntimeError(f"beam search {out.request_id} failed")
    return BeamSearchOutput([
        BeamSearchSequence(
            tokens=list(out.prompt_token_ids) + c.token_ids,
            logprobs=c.logprobs or [],
            cum_logprob=c.cumulative_logprob,
            score=c.cumulative_logprob / len(c.token_ids) ** length_penalty,
            text=c.text,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ])


def _unwrap_prompt(prompt):
    """The text or token ids in vLLM's prompt dicts (``TextPrompt``: ``{"prompt": text}``,
    ``TokensPrompt``: ``{"prompt_token_ids": ids}``); other prompts as they are."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"}:
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    raise ValueError(f"a prompt dict holds either 'prompt' (text) or 'prompt_token_ids', got keys {sorted(keys)} "
                     "(specserve takes no multimodal data or other prompt fields)")
