"""The n samples of one request (``SamplingParams.n > 1``) as n child requests.

Each child is an ordinary request (``{id}[i]``) with ``n = 1`` and, for a
seeded request, seed + i, so sample i is the same whether it is drawn alone or
with its siblings. The first child prefills the prompt; the others are held back
until it has (``ready_to_release``) and then find the prompt's full blocks in
the prefix cache, so the prompt is computed once (and its ``prompt_logprobs``, when asked for,
collected by the first child alone) (all but its last partial
block, which each child computes itself). Without prefix caching all n start at
once. The engine reports the group as ONE ``RequestOutput`` whose ``outputs``
are the children's latest completions, ``index`` i, finished when all are.
"""
from __future__ import annotations

import dataclasses

from specserve.core.request import Request
from specserve.outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from specserve.sampling_params import MAX_SEED, SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s params: n = 1, seed + index; the prompt's logprobs are the first
    child's to collect (the group reports them once), so the others keep their prefix cache hits."""
    seed = None if params.seed is None else (params.seed + index) % (MAX_SEED + 1)
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}[{index}]"


class SampleGroup:
    def __init__(self, request_id: str, children: list[Request], hold_siblings: bool):
        self.request_id = request_id
        self.children = children
        self.held: list[Request] = list(children[1:]) if hold_siblings else []
        self.latest: list[CompletionOutput] = [CompletionOutput(index=i, text="", token_ids=[])
                                               for i in range(len(children))]
        self.last_output: RequestOutput | None = None

    def ready_to_release(self) -> bool:
        """The first child has computed the prompt (it emitted a token) or has ended."""
        first = self.children[0]
        return bool(self.held) and (first.num_output_tokens > 0 or first.is_finished())

    def index_of(self, request_id: str) -> int:
        return next(i for i, c in enumerate(self.children) if c.request_id == request_id)

    def merge(self, child_output: RequestOutput) -> RequestOutput:
        """One child's new output -> the group's cumulative output."""
        i = self.index_of(child_output.request_id)
        self.latest[i] = dataclasses.replace(child_output.outputs[0], index=i)
        stats = SpecDecodeStats()
        for c in self.children:
            stats.merge(c.spec_stats)
        first = self.children[0]
        self.last_output = RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=list(self.latest),
            finished=all(o.finish_reason is not None for o in self.latest)
            or any(o.finish_reason == "error" for o in self.latest),
            spec_decode_stats=stats,
            metrics=dict(child_output.metrics, arrival_time=first.arrival_time,
                         first_token_time=min((c.first_token_time for c in self.children
                                               if c.first_token_time is not None), default=None)),
            prompt_logprobs=first.prompt_logprobs,
        )
        return self.last_output


class SampleGroups:
    """The engine's requests with n > 1, by their own id and by their children's ids.

    A child that fails fails its whole request: its siblings are aborted (``abort``, the
    engine's) and the error is filed under the request's own id.
    """

    def __init__(self):
        self.by_id: dict[str, SampleGroup] = {}
        self._of_child: dict[str, SampleGroup] = {}

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def add(self, group: SampleGroup) -> None:
        self.by_id[group.request_id] = group
        for c in group.children:
            self._of_child[c.request_id] = group

    def pop(self, request_id: str) -> SampleGroup | None:
        group = self.by_id.pop(request_id, None)
        for c in group.children if group is not None else []:
            self._of_child.pop(c.request_id, None)
        return group

    def public_id(self, request_id: str) -> str:
        """The id the user knows: a child's group's, else the request's own."""
        group = self._of_child.get(request_id)
        return group.request_id if group is not None else request_id

    def has_held(self) -> bool:
        return any(g.held for g in self.by_id.values())

    def take_released(self) -> list[Request]:
        """Samples 2..n of a request start once sample 1 has computed the shared prompt."""
        released = []
        for group in self.by_id.values():
            if group.ready_to_release():
                released += group.held
                group.held.clear()
        return released

    def merge_outputs(self, outputs: list[RequestOutput], abort, errors: dict) -> list[RequestOutput]:
        """Children's outputs -> one output per request with n > 1 (the others pass through)."""
        merged: dict[str, RequestOutput] = {}
        passthrough = []
        for out in outputs:
            group = self._of_child.get(out.request_id)
            if group is None:
                passthrough.append(out)
                continue
            if out.outputs[0].finish_reason == "error":
                errors[group.request_id] = errors.pop(out.request_id, None)
                for c in group.children:
                    if c.request_id != out.request_id:
                        abort(c.request_id)
                group.held.clear()
            merged[group.request_id] = group.merge(out)
        for rid, out in merged.items():
            if out.finished or any(o.finish_reason == "error" for o in out.outputs):
                self.pop(rid)
        return passthrough + list(merged.values())
