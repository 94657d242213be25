"""Appending emitted tokens: detokenize, then stop on EOS, stop tokens, stop
strings, max_tokens or max_model_len, one token at a time (a verification step
may emit several tokens; whatever follows a stop is dropped). The text grows by
decoding only the newest tokens (O(1) per token); a finished output is decoded
whole once."""
from __future__ import annotations

from specserve.core.request import Request, RequestStatus
from specserve.outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append(self, req: Request, token_id: int) -> RequestStatus | None:
        """Append one token; return the finishing status, or None to carry on."""
        req.append_token(token_id)
        params = req.sampling_params
        # Under a constraint (req.grammar) an end of sequence is allowed only where the constraint
        # is complete, so it ends the request even with ignore_eos: nothing else could follow.
        if token_id == req.eos_token_id and (not params.ignore_eos or req.grammar is not None):
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if params.stop and req.num_output_tokens >= params.min_tokens:   # (vLLM's: none before min_tokens)
            status = self._check_stop_strings(req)
            if status is not None:
                return status
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def append_verified(self, req: Request, verified) -> tuple[RequestStatus | None, int]:
        """Append a step's ``sample.verify.Verified`` tokens (with their logprobs and sources)
        until one finishes the request -> (finishing status or None, tokens appended)."""
        for i, token in enumerate(verified.token_ids):
            if req.logprobs is not None:
                req.logprobs.append(verified.logprobs[i])
            req.token_sources.append(verified.sources[i])
            status = self.append(req, token)
            if status is not None:
                return status, i + 1
        return None, len(verified.token_ids)

    def _check_stop_strings(self, req: Request) -> RequestStatus | None:
        previous = len(req.output_text)
        text = self._decode_new_tokens(req)
        # Only the tail can hold a new match: look back a stop string's length.
        window = max(len(s) for s in req.sampling_params.stop) + 16
        for stop in req.sampling_params.stop:
            at = text.find(stop, max(0, previous - window))
            if at >= 0:
                req.output_text = text[: at + len(stop) if req.sampling_params.include_stop_str_in_output else at]
                req.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        return None

    def _decode_new_tokens(self, req: Request) -> str:
        """``req.output_text`` grown by the text of the tokens since the last call, decoding a
        few tokens each time instead of the whole output (vLLM's prefix and read offsets): the
        tokens from ``prefix_offset`` give the context a token's text depends on, and text is
        only taken once it does not end in a partial UTF-8 character."""
        ids, skip = req.output_token_ids, req.sampling_params.skip_special_tokens
        before = self.tokenizer.decode(ids[req.detok_prefix_offset : req.detok_read_offset], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[req.detok_prefix_offset :], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            req.output_text += after[len(before):]
            req.detok_prefix_offset, req.detok_read_offset = req.detok_read_offset, len(ids)
        return req.output_text

    def decode(self, req: Request) -> str:
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens)

    def make_output(self, req: Request, error: BaseException | None = None) -> RequestOutput:
        """The request's cumulative output. With ``error`` (the request failed on its
        own): finish_reason "error" and the text as last decoded (decoding may be what failed)."""
        if error is None and not isinstance(req.stop_reason, str):   # a stop string has cut the text already
            # a few tokens decoded per step; the whole output once, when it is final
            req.output_text = self.decode(req) if req.is_finished() else self._decode_new_tokens(req)
        finish = "error" if error is not None else req.status.value if req.is_finished() else None
        completion = CompletionOutput(
            index=0,
            text=req.output_text,
            token_ids=list(req.output_token_ids),
            finish_reason=finish,
            stop_reason=req.stop_reason,
            logprobs=req.logprobs,
            token_sources=list(req.token_sources),
            spec_decode_stats=req.spec_stats,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.is_finished() or error is not None,
            spec_decode_stats=req.spec_stats,
            metrics={
                "arrival_time": req.arrival_time,
                "first_token_time": req.first_token_time,
                "finish_time": req.finish_time,
                "num_preemptions": req.num_preemptions,
                # prompt tokens found in the prefix cache when the request was (last) admitted
                "num_cached_tokens": min(req.num_cached_tokens, len(req.prompt_token_ids)),
            },
            prompt_logprobs=req.prompt_logprobs,
        )
