"""POST /v1/embeddings (OpenAI's, as vLLM and llama-server serve it): each input's pooled final
hidden state (``engine/embedding.py``: ``--pooling``, unit length), as floats or base64 float32; and
llama-server's own POST /embedding (and /embeddings): ``content`` (or ``input``) -> ``[{"index",
"embedding": [vector]}]``, normalized as its ``embd_normalize`` says."""
from __future__ import annotations

import base64

import numpy as np
from fastapi.responses import JSONResponse

from specserve.engine.embedding import EmbeddingNoRoomError
from specserve.entrypoints.openai.limits import APIError


def encoded(vector: list[float], encoding_format: str):
    """The embedding as OpenAI returns it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def llama_normalized(vector: list[float], embd_normalize: int) -> list[float]:
    """llama-server's ``embd_normalize``: -1 none, 0 scaled so the largest magnitude is 32760 (int16),
    1 taxicab, 2 euclidean (its default), p > 2 the p-norm."""
    v = np.asarray(vector, dtype=np.float64)
    if embd_normalize < 0:
        norm = 1.0
    elif embd_normalize == 0:
        norm = np.abs(v).max() / 32760.0
    elif embd_normalize == 2:
        norm = np.sqrt((v * v).sum())
    else:
        norm = (np.abs(v) ** embd_normalize).sum() ** (1.0 / embd_normalize)
    return (v / norm if norm > 0 else v).astype(np.float32).tolist()


async def _embed_all(serving, inputs: list, lora, normalize: bool, param: str) -> tuple[list, int]:
    """(each input's EmbeddingRequestOutput, one after the other; their prompt tokens); 400 / 503 as
    the module says."""
    if len(inputs) > serving.limits.max_prompts:
        raise APIError(400, f"at most {serving.limits.max_prompts} inputs per request, got {len(inputs)}",
                       param=param, code="too_many_prompts")
    serving.metrics.requests.labels(serving.model_name, "embeddings").inc()
    outs = []
    for i, item in enumerate(inputs):
        try:
            outs.append(await serving.async_engine.embed(item, lora_request=lora, normalize=normalize))
        except ValueError as e:
            raise APIError(400, f"{param} {i}: {e}", param=param, code="invalid_prompt") from None
        except EmbeddingNoRoomError as e:
            raise APIError(503, f"the server is busy: {e}", "server_error", code="server_busy") from None
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    serving.metrics.prompt_tokens.labels(serving.model_name).inc(tokens)
    return outs, tokens


async def native_embeddings(serving, req, raw) -> JSONResponse:
    """llama-server's POST /embedding: ``[{"index": i, "embedding": [vector]}]``."""
    if req.embd_normalize < -1:
        raise APIError(400, "embd_normalize must be -1 (none), 0, 1, 2 (euclidean) or a larger p",
                       param="embd_normalize", code="invalid_value")
    outs, _ = await _embed_all(serving, req.inputs(), serving.request_lora(req), False, "content")
    return JSONResponse([{"index": i, "embedding": [llama_normalized(o.outputs.embedding, req.embd_normalize)]}
                         for i, o in enumerate(outs)])


async def create_embeddings(serving, req, raw) -> JSONResponse:
    lora = serving.request_lora(req)
    inputs = req.inputs()
    width = serving.engine.hf_config.hidden_size
    if req.dimensions is not None and req.dimensions != width:
        raise APIError(400, f"this model's embeddings have {width} dimensions; dimensions {req.dimensions} cannot "
                            f"be given", param="dimensions", code="invalid_value")
    outs, tokens = await _embed_all(serving, inputs, lora, True, "input")
    data = [{"object": "embedding", "index": i, "embedding": encoded(o.outputs.embedding, req.encoding_format)}
            for i, o in enumerate(outs)]
    return JSONResponse({"object": "list", "data": data, "model": serving.answer_model(req),
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
