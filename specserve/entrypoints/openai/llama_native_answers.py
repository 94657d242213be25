"""llama-server's answers from the completions handler's stream (``llama_native.py`` rewrites the
request; this module the answer): each ``/completion`` or ``/infill`` answer built piece by piece
as the engine verifies tokens (``NativeAnswers`` dispatches the chunks' choices to their answer,
``n_cmpl`` of them), with llama-server's code-completion cut-offs (``n_indent``,
``t_max_predict_ms``), its fields and timings, ``completion_probabilities`` and
``response_fields``.
"""
from __future__ import annotations

import time
from contextlib import aclosing

from specserve.entrypoints.openai.limits import APIError
from specserve.entrypoints.openai.response_format import chat_chunks, sse


class NativeAnswers:
    """The completions handler's stream -> llama-server's answers (``n_cmpl`` of them), piece by
    piece and whole: each chunk's choices go to their answer, and reading stops once every answer
    has ended (the engine's end, or a cut-off), which aborts the request."""

    def __init__(self, serving, req, prompt, clock=time.monotonic):
        # req: the NativeRequest (llama_native.py); prompt: its text or token ids
        self.answers = [NativeAnswer(serving, req, prompt, clock, index=i) for i in range(req.n_cmpl)]

    async def pieces(self, chunks):
        """(index, text, tokens) of each new piece of an answer, as the engine verifies them."""
        async with aclosing(chat_chunks(chunks)) as parsed:
            async for chunk in parsed:
                if "error" in chunk:
                    raise APIError(500, chunk["error"].get("message", "engine error"), "server_error",
                                   code=chunk["error"].get("code"))
                for answer in self.answers:
                    answer.usage = chunk.get("usage") or answer.usage
                for choice in chunk.get("choices", []):
                    answer = self.answers[choice.get("index", 0)]
                    piece = answer.take(choice)
                    if piece is not None:
                        yield (answer.index, *piece)
                if all(a.cut or a.finish for a in self.answers):
                    return

    async def events(self, chunks):
        """llama-server's stream: a ``data:`` object per piece, then each answer's whole fields."""
        async with aclosing(self.pieces(chunks)) as pieces:
            async for index, text, new_tokens in pieces:
                answer = self.answers[index]
                yield sse({"index": index, "content": text, "tokens": new_tokens, "stop": False, "id_slot": 0,
                           "tokens_predicted": len(answer.tokens),
                           "tokens_evaluated": answer.usage.get("prompt_tokens", 0)})
        for answer in self.answers:
            yield sse(answer.final())

    def final(self) -> dict | list[dict]:
        """The answer, or with ``n_cmpl`` above 1 the list of them (llama-server's shape)."""
        finals = [a.final() for a in self.answers]
        return finals[0] if len(finals) == 1 else finals


class NativeAnswer:
    """One answer: its text, tokens and timings as its pieces come, and llama-server's fields."""

    def __init__(self, serving, req, prompt, clock=time.monotonic, index: int = 0):
        self.serving, self.req, self.index = serving, req, index
        self.clock = clock                # seconds (the tests' own clock replaces it)
        self.prompt = prompt
        self.warm_only = req.n_predict == 0
        self.content, self.tokens, self.probs = "", [], []
        self.start = clock()
        self.first = self.last = None
        self.usage: dict = {}
        self.finish, self.stop_word, self.stats = None, "", None
        self.cut = False                  # ended by n_indent or t_max_predict_ms
        self.has_new_line = False
        self.line_start = None            # where the current line starts in content, after a new line

    def take(self, choice: dict):
        """A chunk's choice for this answer -> its new (text, tokens), or None."""
        if self.cut:
            return None
        ext = choice.get("specserve") or {}
        new_tokens = [t["id"] for t in ext.get("tokens", [])]
        if ext.get("stats"):
            self.stats = ext["stats"]
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            self.stop_word = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else ""
        if self.warm_only or not (new_tokens or choice.get("text")):
            return None
        now = self.clock()
        self.first = self.first or now
        self.last = now
        if choice.get("logprobs"):
            self.probs += _probs(choice["logprobs"], new_tokens)
        text = self._cut_by_indent(choice.get("text") or "")
        self.content += text
        self.tokens += new_tokens
        limit = self.req.t_max_predict_ms
        if not self.cut and self.has_new_line and limit and (now - self.first) * 1000 > limit:
            self.cut = True
        return text, new_tokens

    def _cut_by_indent(self, text: str) -> str:
        """``text`` up to where a new line starts indented less than ``n_indent`` (llama-server's
        rule: the answer ends there, that line's text cut)."""
        out = ""
        for ch in text:
            if self.cut:
                break
            if ch == "\n":
                self.has_new_line, self.line_start = True, len(self.content) + len(out) + 1
            elif self.req.n_indent and self.line_start is not None and ch not in " \t":
                indent = len(self.content) + len(out) - self.line_start
                self.line_start = None
                if indent < self.req.n_indent:
                    self.cut = True
                    break
            out += ch
        if self.cut and self.req.n_indent:
            whole = self.content + out
            out = out[: max(0, whole.rfind("\n") + 1 - len(self.content))]
        return out

    def final(self) -> dict:
        usage, req = self.usage, self.req
        prompt_n = usage.get("prompt_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        predicted = len(self.tokens)
        first = self.first or self.clock()
        prompt_ms = (first - self.start) * 1000
        predicted_ms = ((self.last or first) - first) * 1000
        if self.cut:
            stop_type = "limit"
        else:
            stop_type = {"length": "limit"}.get(self.finish, "word" if self.stop_word else "eos")
        timings = {"cache_n": cached, "prompt_n": prompt_n - cached, "prompt_ms": prompt_ms,
                   "prompt_per_token_ms": prompt_ms / max(1, prompt_n - cached),
                   "prompt_per_second": 1000 * (prompt_n - cached) / prompt_ms if prompt_ms else 0.0,
                   "predicted_n": predicted, "predicted_ms": predicted_ms,
                   "predicted_per_token_ms": predicted_ms / max(1, predicted),
                   "predicted_per_second": 1000 * predicted / predicted_ms if predicted_ms else 0.0}
        if self.stats is not None and self.stats.get("num_draft_tokens"):
            timings["draft_n"] = self.stats["num_draft_tokens"]
            timings["draft_n_accepted"] = self.stats["num_accepted_tokens"]
        body = {
            "index": self.index, "content": self.content, "tokens": self.tokens if req.return_tokens else [],
            "id_slot": 0, "stop": True, "model": self.serving.model_name,
            "tokens_predicted": predicted, "tokens_evaluated": prompt_n,
            "generation_settings": {"n_predict": req.n_predict, "temperature": req.temperature, "top_k": req.top_k,
                                    "top_p": req.top_p, "min_p": req.min_p, "seed": req.seed, "stop": req.stop,
                                    "n_probs": req.n_probs, "n_indent": req.n_indent,
                                    "t_max_predict_ms": req.t_max_predict_ms, "n_ctx": self.serving.engine.max_model_len},
            "prompt": self.prompt if isinstance(self.prompt, str) else self.serving.tokenizer.decode(self.prompt),
            "has_new_line": self.has_new_line, "truncated": False, "stop_type": stop_type,
            "stopping_word": self.stop_word if stop_type == "word" else "", "tokens_cached": cached,
            "timings": timings,
        }
        if req.n_probs > 0:
            body["completion_probabilities"] = self.probs
        return _only(body, req.response_fields) if req.response_fields else body


def _probs(logprobs: dict, ids: list[int]) -> list[dict]:
    """OpenAI completions' logprobs of a chunk -> llama-server's ``completion_probabilities``."""
    out = []
    for i, (token, logprob) in enumerate(zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", []))):
        top = (logprobs.get("top_logprobs") or [])
        alternatives = top[i] if i < len(top) and top[i] else {}
        out.append({"id": ids[i] if i < len(ids) else None, "token": token, "logprob": logprob,
                    "bytes": list(token.encode("utf-8")),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                                     for t, lp in alternatives.items()]})
    return out


def _only(body: dict, fields: list[str]) -> dict:
    """llama-server's ``response_fields``: the named fields only; ``a/b`` takes ``b`` out of ``a``
    under the name ``a/b``; a missing field is left out."""
    out = {}
    for name in fields:
        value, found = body, True
        for part in name.split("/"):
            if isinstance(value, dict) and part in value:
                value = value[part]
            else:
                found = False
                break
        if found:
            out[name] = value
    return out
