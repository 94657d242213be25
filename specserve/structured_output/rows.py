"""Which logits rows get which grammar masks: a verification step's rows, and a proposer's.

Requests are read duck-typed (``core.request.Request``: ``grammar``, ``draft_token_ids``);
a request without a grammar keeps its rows untouched, and a step without constrained
requests costs nothing (the same tensor comes back).
"""
from __future__ import annotations

import torch

from specserve.structured_output.bitmask import apply_bitmask_


def mask_verified_rows(reqs: list, logits: torch.Tensor) -> torch.Tensor:
    """logits [sum (n_i + 1), V] of a verification step (request i's last token and its n_i
    drafts) -> the same rows with each constrained request's ``grammar.step_bitmask`` applied:
    row j of a request is masked by the grammar's state after its drafts before j (its
    ancestors, in a tree), the bonus row included. Greedy, tree and rejection-sampling paths
    then all sample from the constrained target distribution."""
    for r in reqs:
        if getattr(r, "grammar", None) is not None and r.grammar.failed is not None:
            raise r.grammar.failed    # the verifier's isolation fails this request alone
    constrained = [getattr(r, "grammar", None) is not None and r.grammar.step_bitmask is not None for r in reqs]
    if not any(constrained):
        return logits
    out, row = logits.float().clone(), 0
    for r, masked in zip(reqs, constrained):
        n = len(r.draft_token_ids) + 1
        if masked:
            bitmask = r.grammar.step_bitmask
            if bitmask.shape[0] != n:
                raise RuntimeError(f"request {r.request_id}: {bitmask.shape[0]} grammar masks for {n} verified rows")
            apply_bitmask_(out[row : row + n], bitmask)
        row += n
    return out


def mask_draft_rows(logits: torch.Tensor, reqs: list, drafts: list[list[int]]) -> torch.Tensor:
    """A proposer's logits [R, V] for the next draft of requests ``reqs`` (drafts so far
    ``drafts``), each constrained row masked by its grammar's state after those drafts, so the
    draft model and EAGLE sample their drafts under the target's constraint (acceptance stays
    high; exactness does not depend on it). A row the mask would leave without a finite logit
    (a reduced draft vocabulary without any allowed token) keeps its logits: its draft is then
    checked like any other, and its probabilities stay a distribution."""
    rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    if not rows:
        return logits
    out = logits.float().clone()
    for i in rows:
        g = reqs[i].grammar
        if g.valid_prefix(drafts[i]) != len(drafts[i]):
            continue   # an earlier draft left the grammar (unmasked row): nothing to aim at
        masked = apply_bitmask_(out[i : i + 1].clone(), g.mask_after(drafts[i]).unsqueeze(0))
        if torch.isfinite(masked).any():
            out[i : i + 1] = masked
    return out
