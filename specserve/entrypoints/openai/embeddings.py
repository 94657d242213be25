"""POST /v1/embeddings (OpenAI's, as vLLM and llama-server serve it): each input's pooled final
hidden state (``engine/embedding.py``: ``--pooling``, unit length), as floats or base64 float32."""
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


async def create_embeddings(serving, req, raw) -> JSONResponse:
    lora = serving.request_lora(req)
    inputs = req.inputs()
    if len(inputs) > serving.limits.max_prompts:
        raise APIError(400, f"at most {serving.limits.max_prompts} inputs per request, got {len(inputs)}",
                       param="input", code="too_many_prompts")
    width = serving.engine.hf_config.hidden_size
    if req.dimensions is not None and req.dimensions != width:
        raise APIError(400, f"this model's embeddings have {width} dimensions; dimensions {req.dimensions} cannot "
                            f"be given", param="dimensions", code="invalid_value")
    serving.metrics.requests.labels(serving.model_name, "embeddings").inc()
    data, tokens = [], 0
    for i, item in enumerate(inputs):
        try:
            out = await serving.async_engine.embed(item, lora_request=lora)
        except ValueError as e:
            raise APIError(400, f"input {i}: {e}", param="input", code="invalid_prompt") from None
        except EmbeddingNoRoomError as e:
            raise APIError(503, f"the server is busy: {e}", "server_error", code="server_busy") from None
        tokens += len(out.prompt_token_ids)
        data.append({"object": "embedding", "index": i, "embedding": encoded(out.outputs.embedding, req.encoding_format)})
    return JSONResponse({"object": "list", "data": data, "model": serving.answer_model(req),
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
