"""A request's structured-output fields -> one ``StructuredOutput``, checked before engine work.

Where a constraint can come from: OpenAI's ``response_format`` (``json_object``, or
``json_schema`` with its ``schema``), vLLM's ``structured_outputs`` (``json``, ``json_object``,
``regex``, ``choice``, ``grammar``), vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, and for chat ``tool_choice`` "required" or a named
function (``tool_calls.py``). At most one per request; two are a 400 naming both.

``check`` answers 400 before the request reaches the engine: a constraint larger than
``ServerLimits.max_structured_output_bytes`` (``structured_output_too_large``), and one the
engine's compiler refuses (an invalid schema, regex or grammar: ``invalid_structured_output``;
one that runs out of the grammar limits in its first tokens: ``structured_output_too_complex``).
Compiling runs on the tokenizer thread and is cached, so the engine's own check when the
request is queued is a lookup.
"""
from __future__ import annotations

import dataclasses

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.entrypoints.openai.limits import APIError
from specserve.sampling_params import SamplingParams, StructuredOutput
from specserve.structured_output.compiler import InvalidConstraintError


def requested(request) -> tuple[StructuredOutput | None, str | None]:
    """(the constraint the request's own fields ask for, the field it came from)."""
    found: list[tuple[str, dict]] = []
    rf = request.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_
        found.append(("response_format", {"json_schema": schema} if schema is not None else {"json_object": True}))
    so = request.structured_outputs
    if so is not None:
        fields = {"json_schema": so.json_, "json_object": so.json_object or False, "regex": so.regex,
                  "choice": so.choice, "grammar": so.grammar}
        found.append(("structured_outputs", {k: v for k, v in fields.items() if v not in (None, False)}))
    for name, key in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(request, name) is not None:
            found.append((name, {key: getattr(request, name)}))
    if not found:
        return None, None
    if len(found) > 1:
        names = [f for f, _ in found]
        raise APIError(400, f"at most one structured-output constraint per request, got {names}", param=names[1],
                       code="invalid_value")
    field, fields = found[0]
    return build(fields, field)


def build(fields: dict, field: str) -> tuple[StructuredOutput, str]:
    try:
        return StructuredOutput(**fields), field
    except ValueError as e:
        raise APIError(400, f"{field}: {str(e).removeprefix('invalid StructuredOutput: ')}", param=field,
                       code="invalid_value") from None


async def check(async_engine: AsyncLLMEngine, params: SamplingParams, field: str, max_bytes: int) -> None:
    """400 for a constraint too large or one the engine's compiler refuses (module docstring)."""
    so = params.structured_output
    size = len(so.source.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise APIError(400, f"{field}: the {so.kind} is {size} bytes, more than the limit of {max_bytes} "
                            "(--max-structured-output-bytes)", param=field, code="structured_output_too_large")
    try:
        await async_engine.run_off_thread(async_engine.engine.constraints.check, params)
    except InvalidConstraintError as e:
        raise APIError(400, f"{field}: {e}", param=field, code=e.code) from None


def with_constraint(params: SamplingParams, so: StructuredOutput) -> SamplingParams:
    return dataclasses.replace(params, structured_output=so)
