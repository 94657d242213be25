"""A scheduled request -> the target's ForwardInput, and the K/V moves a tree's accepted branch needs."""
from __future__ import annotations

from specserve.core.scheduler import ScheduledRequest
from specserve.engine.prompt_logprobs import prompt_rows
from specserve.model_executor.layers.attention import tree_layout
from specserve.worker.model_runner import ForwardInput


def forward_input(s: ScheduledRequest, block_table: list[int]) -> ForwardInput:
    """[prefill chunk] or [last token, drafts...]; logits for the last token and every draft
    when the request will sample this step, after those of the prompt positions it collects
    prompt logprobs for (``prompt_logprobs.prompt_rows``)."""
    req = s.request
    start = req.num_computed_tokens
    n = s.num_new_tokens
    tokens = req.all_token_ids[start : start + n] + req.draft_token_ids
    lead, _ = prompt_rows(req, start, n, s.will_sample)
    tree_parents = None
    if req.draft_parents is not None:  # new tokens in a chain, then drafts under the last one
        tree_parents = list(range(-1, n - 1)) + [p + n if p >= 0 else n - 1 for p in req.draft_parents]
    return ForwardInput(
        token_ids=tokens,
        start_position=start,
        block_table=block_table,
        num_logits=lead + (len(req.draft_token_ids) + 1 if s.will_sample else 0),
        tree_parents=tree_parents,
        lora_id=req.lora_id,
    )


def tree_branch_moves(path: list[int], last: int) -> list[tuple[int, int]]:
    """(from, to) positions of the accepted branch's drafts whose K/V is not where it belongs.

    Draft i was computed in slot last + 1 + i (``last``: the position of the request's last
    token); the token accepted at depth d belongs at last + d. Drafts that already sit there
    (the first branch, as laid out) need no move.
    """
    return [(last + 1 + node, last + depth) for depth, node in enumerate(path, 1) if node != depth - 1]


def drafts_per_depth(parents: list[int]) -> list[int]:
    """[number of draft tokens at position 1, 2, ...] of a tree of drafts."""
    depths, _ = tree_layout(parents)       # 0 for the last token's children
    counts = [0] * (max(depths, default=-1) + 1)
    for d in depths:
        counts[d] += 1
    return counts
