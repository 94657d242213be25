"""Logit bias and repetition / frequency / presence penalties, position by position.

A penalty depends on the tokens before the position it samples. In a plain
decoding step that is the request's prompt and output; in a verification step
row j of a request (the distribution after draft token j) also counts draft
tokens 1..j, since rejection sampling only emits row j's token after accepting
them. So each row gets its own "extra" tokens: the draft tokens on the path
from the request's last token to that row (``draft_histories``). Getting this
wrong keeps the output plausible but changes its distribution, which is why
the end-to-end test compares sampled distributions, not single outputs.

``min_tokens`` bans the end-of-sequence token and ``stop_token_ids`` from every row whose
output index (the output so far plus that row's drafts) is below it; ``allowed_token_ids``
bans every other token from every row; ``bad_words`` ban a word's last token in a row whose
tokens before it (prompt, output and that row's drafts) end with the word's others.

The order and formulas are vLLM's (and, for repetition, transformers'):
bias first, then repetition (prompt and output tokens: positive logits are
divided by the penalty, negative ones multiplied), then frequency (times the
token's count in the output) and presence (once if it is in the output).
The proposers that have distributions (draft model, EAGLE) apply the same
adjustments to their own logits so their drafts aim at the same target; that
only raises acceptance, since rejection sampling is exact for any draft.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.sampling_params import SamplingParams


def draft_histories(num_drafts: int, parents: Sequence[int] | None = None) -> list[list[int]]:
    """For rows 0..num_drafts of one request: the indices of the draft tokens before each row.

    Chains (``parents`` None): row j follows drafts 0..j-1. Trees: row 1 + i follows
    draft i and its ancestors (``parents[i]`` = -1 for a child of the last token).
    """
    if parents is None:
        return [list(range(j)) for j in range(num_drafts + 1)]
    paths: list[list[int]] = []
    for i, parent in enumerate(parents[:num_drafts]):
        paths.append((paths[parent] if parent >= 0 else []) + [i])
    return [[]] + paths


def adjust_logits(
    logits: torch.Tensor,                 # [R, V] one request's rows (not modified)
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    extra_token_ids: Sequence[Sequence[int]],  # [R] tokens after the output, before each row
    eos_token_id: int | None = None,
    bad_words_ids: Sequence[Sequence[int]] = (),   # the bad words' token sequences (bad_words_token_ids)
) -> torch.Tensor:
    """-> [R, V] float32 logits with the request's bias and penalties applied, the ends
    (``eos_token_id``, ``stop_token_ids``) banned from rows whose output index is below
    ``min_tokens``, and the token that would complete a bad word banned."""
    rows, vocab = logits.shape
    device = logits.device
    out = logits.float().clone()
    _ban_ends_before_min_tokens(out, params, len(output_token_ids), extra_token_ids, eos_token_id)
    _ban_bad_words(out, prompt_token_ids, output_token_ids, extra_token_ids, bad_words_ids)
    if params.allowed_token_ids is not None:
        keep = torch.full((vocab,), float("-inf"), device=device)
        keep[torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long, device=device)] = 0.0
        out += keep
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        out[:, ids] += bias
    if params.presence_penalty == 0.0 and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0:
        return out
    counts = _row_counts(output_token_ids, extra_token_ids, rows, vocab, device)   # [R, V] float32
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_token_ids:
            in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            in_prompt[torch.tensor(list(prompt_token_ids), dtype=torch.long, device=device)] = True
            seen |= in_prompt
        penalty = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if params.frequency_penalty != 0.0:
        out -= params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        out -= params.presence_penalty * (counts > 0).float()
    return out


def _ban_ends_before_min_tokens(out: torch.Tensor, params: SamplingParams, num_output: int,
                                extra_token_ids: Sequence[Sequence[int]], eos_token_id: int | None) -> None:
    """Row r samples output index num_output + len(extra r): below min_tokens, -inf for the tokens
    that would end the output (in place). A bias applied later cannot lift them (-inf + b)."""
    if params.min_tokens <= num_output:
        return
    ends = [t for t in [eos_token_id, *params.stop_token_ids] if t is not None and t < out.shape[1]]
    early = [r for r, extra in enumerate(extra_token_ids) if num_output + len(extra) < params.min_tokens]
    if ends and early:
        out[torch.tensor(early, device=out.device)[:, None], torch.tensor(ends, device=out.device)[None, :]] = \
            float("-inf")


def _ban_bad_words(out: torch.Tensor, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                   extra_token_ids: Sequence[Sequence[int]], bad_words_ids: Sequence[Sequence[int]]) -> None:
    """-inf (in place) for a bad word's last token in every row whose tokens before it (the
    prompt, the output, that row's drafts) end with the word's other tokens."""
    if not bad_words_ids:
        return
    longest = max(len(w) for w in bad_words_ids) - 1
    history = (list(prompt_token_ids) + list(output_token_ids))[-longest:] if longest else []
    for r, extra in enumerate(extra_token_ids):
        before = (history + list(extra))[-longest:] if longest else []
        banned = [w[-1] for w in bad_words_ids if w[-1] < out.shape[1]
                  and (len(w) == 1 or before[len(before) - len(w) + 1:] == list(w[:-1]))]
        if banned:
            out[r, torch.tensor(banned, device=out.device)] = float("-inf")


def bad_words_token_ids(tokenizer, words: Sequence[str] | None) -> list[list[int]]:
    """Each bad word's token sequences, as vLLM forms them: the word alone and after a space
    (a word inside a text is usually tokenized with its space), without duplicates."""
    out: list[list[int]] = []
    for word in words or []:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def adjust_request_rows(logits: torch.Tensor, reqs: Sequence, outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """``adjust_each_row`` for a proposer's step: row r is request ``reqs[r]``'s next position
    after ``outputs[r]`` (its output and drafts so far); each request brings its own params,
    prompt, end-of-sequence token and bad words."""
    return adjust_each_row(logits, [r.sampling_params for r in reqs], [r.prompt_token_ids for r in reqs], outputs,
                           [r.eos_token_id for r in reqs], [r.bad_words_ids for r in reqs])


def _row_counts(output_token_ids, extra_token_ids, rows: int, vocab: int, device) -> torch.Tensor:
    """[R, V] how often each token occurs in the output plus row r's extra tokens."""
    counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
    if output_token_ids:
        output = torch.tensor(list(output_token_ids), dtype=torch.long, device=device)
        counts += torch.bincount(output, minlength=vocab).float()
    row_index = [r for r, extra in enumerate(extra_token_ids) for _ in extra]
    if row_index:
        token_index = [t for extra in extra_token_ids for t in extra]
        counts.index_put_(
            (torch.tensor(row_index, device=device), torch.tensor(token_index, dtype=torch.long, device=device)),
            torch.ones(len(row_index), device=device),
            accumulate=True,
        )
    return counts


def adjust_each_row(
    logits: torch.Tensor,                       # [R, V], one row per request (a proposer's step)
    params: Sequence[SamplingParams],           # [R]
    prompts: Sequence[Sequence[int]],           # [R] each row's prompt
    outputs: Sequence[Sequence[int]],           # [R] each row's output, drafts so far included
    eos_token_ids: Sequence[int | None] | None = None,   # [R] each row's end-of-sequence token
    bad_words_ids: Sequence[Sequence[Sequence[int]]] | None = None,   # [R] each row's bad words' tokens
) -> torch.Tensor:
    """``adjust_logits`` for rows of different requests; the same tensor when none adjusts."""
    todo = [r for r, p in enumerate(params) if p.adjusts_logits]
    if not todo:
        return logits
    out = logits.float().clone()
    for r in todo:
        eos = None if eos_token_ids is None else eos_token_ids[r]
        bad = () if bad_words_ids is None else bad_words_ids[r]
        out[r : r + 1] = adjust_logits(logits[r : r + 1], params[r], prompts[r], outputs[r], [[]], eos, bad)
    return out
