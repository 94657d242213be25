"""Verification: one step's target logits and each request's drafts -> the tokens it emits.

Three ways to choose tokens give the same distribution as plain decoding: all-greedy
batches of chains compare drafts with the target's argmax on the host (``_greedy_tokens``); an
unseeded sampled request with a draft's probabilities runs the rejection sampler over
processed probabilities (``_sampled_tokens``, ``rejection_sampler``); every other request
(drafts one-hot, as a chain or a tree, or none; or seeded) takes the target's own choice
at every node and walks the drafts (``_chosen_tokens``, ``tree_sampler``).

Why seeded requests never take the rejection sampler: its token at a position depends on
whether a draft stood there and what the draft's q was, and that changes with batching
(``disable_by_batch_size``, the token budget's lookahead), preemption (a recomputed request
samples its next token without drafts) and the proposer's state (suffix decoding learns
from other requests). The target's choice for output index j is the exponential race with
``keyed_generator(seed, j, CHOICE)``, the same numbers whatever came before, so a seeded
request's tokens are those of plain decoding with its seed. A draft model drafts
with the same noise (``sampler.choose_tokens``), which couples its guess to the target's
choice; that accepts a little less often than rejection sampling's sum of min(p, q)
(docs/speculative_decoding.md, "Seeded requests"), which unseeded requests, promised no
particular draw, keep.

Each request's result is a ``Verified``: the tokens to append, how many drafts were
accepted, their log-probabilities, the accepted tree path and how each token came.

``reqs`` are the engine's requests (``core.request.Request``), read for their drafts
(``draft_token_ids``, ``draft_parents``, ``draft_probs``), ``sampling_params``, ``seed``
and token history; this module does not import the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.outputs import step_token_sources
from specserve.sample.logprobs import logprob_rows
from specserve.sample.penalties import adjust_logits, draft_histories
from specserve.sample.rejection_sampler import rejection_sample
from specserve.sample.sampler import (CHOICE, REJECTION, SamplingTensors, keyed_generator, processed_probs,
                                      row_argmax)
from specserve.sample.tree_sampler import node_depths, target_choices, walk_tree, walk_tree_rejection
from specserve.structured_output.rows import mask_verified_rows


@dataclass
class Verified:
    """One request's result of a verification step."""

    token_ids: list[int]             # to append: the accepted drafts, then the target's own token
    num_accepted: int                # drafts accepted
    logprobs: list | None            # per token, {token id: Logprob} (chosen + top n), if asked
    tree_path: list[int] | None      # accepted draft indices down a tree; None for a chain
    sources: list[str]               # per token, outputs.TOKEN_SOURCE_* (plain / accepted / recovered / bonus)


class Verifier:
    """Chooses each step's emitted tokens (module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device, tokenizer):
        self.vocab_size = vocab_size
        self.device = device
        self.tokenizer = tokenizer

    def verify_isolated(self, reqs: list, logits: torch.Tensor) -> dict:
        """``verify`` over the batch; if it raises, each request again alone, so the
        failing one gets its exception and the others their tokens. A request's random
        numbers are keyed by its seed and output indices, not drawn from a running
        generator, so verifying it again draws the same numbers as if nothing failed."""
        try:
            return self.verify(reqs, logits)
        except Exception as e:  # noqa: BLE001
            if len(reqs) == 1:
                return {reqs[0].request_id: e}
        result, row = {}, 0
        for r in reqs:
            rows = len(r.draft_token_ids) + 1
            try:
                result.update(self.verify([r], logits[row : row + rows]))
            except Exception as e:  # noqa: BLE001
                result[r.request_id] = e
            row += rows
        return result

    def verify(self, reqs: list, logits: torch.Tensor) -> dict[str, "Verified"]:
        """logits [sum (n_i + 1), V] (request i's last token and its n_i drafts) -> {request_id:
        Verified}. Log-probabilities are those of the raw logits (vLLM's default); tokens come
        from the adjusted ones (bias, penalties)."""
        counts = [len(r.draft_token_ids) for r in reqs]
        params = [r.sampling_params for r in reqs]
        raw_logits, logits = logits, self.adjusted_logits(reqs, logits)
        logits = mask_verified_rows(reqs, logits)   # structured output: each row's grammar mask
        if all(p.greedy for p in params) and all(r.draft_parents is None for r in reqs):
            token_ids, num_accepted = self._greedy_tokens(reqs, logits)
            paths: list[list[int] | None] = [None] * len(reqs)
        else:
            token_ids, num_accepted, paths = self._sampled_or_chosen(reqs, counts, logits)
        # Row (within the request's logits) of each emitted token's distribution.
        rows_of_emitted = [list(range(num_accepted[b] + 1)) if paths[b] is None else [0] + [1 + i for i in paths[b]]
                           for b in range(len(reqs))]
        logprobs = self._logprobs(reqs, raw_logits, [n + 1 for n in counts], rows_of_emitted, token_ids)
        result = {}
        for b, r in enumerate(reqs):
            emitted = token_ids[b][: num_accepted[b] + 1]
            sources = step_token_sources(counts[b], num_accepted[b], ends_at_leaf(r, num_accepted[b], paths[b]))
            result[r.request_id] = Verified(emitted, num_accepted[b], logprobs[b], paths[b], sources)
            r.draft_probs = None
        return result

    def _sampled_or_chosen(self, reqs, counts, logits: torch.Tensor):
        """Requests ``rejection_sampled`` through the rejection sampler, the others through the
        target's choices; each part over its own rows of ``logits`` -> (token_ids, num_accepted,
        paths), in ``reqs``' order."""
        token_ids: list = [None] * len(reqs)
        num_accepted, paths = [0] * len(reqs), [None] * len(reqs)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n + 1)
        route = [(TREE_REJECTION if r.draft_parents is not None else CHAIN_REJECTION) if rejection_sampled(r)
                 else CHOSEN for r in reqs]
        for wanted, choose in ((CHOSEN, self._chosen_tokens), (CHAIN_REJECTION, self._sampled_tokens),
                               (TREE_REJECTION, self._tree_rejection_tokens)):
            part = [b for b in range(len(reqs)) if route[b] == wanted]
            if not part:
                continue
            rows = logits
            if len(part) < len(reqs):
                index = [i for b in part for i in range(starts[b], starts[b + 1])]
                rows = logits.index_select(0, torch.tensor(index, device=logits.device))
            part_tokens, part_accepted, part_paths = choose([reqs[b] for b in part], rows)
            for j, b in enumerate(part):
                token_ids[b], num_accepted[b], paths[b] = part_tokens[j], part_accepted[j], part_paths[j]
        return token_ids, num_accepted, paths

    @staticmethod
    def adjusted_logits(reqs: list, logits: torch.Tensor) -> torch.Tensor:
        """Logit bias and penalties, each row counting the draft tokens before it
        (``sample.penalties``); the same tensor when no request uses them."""
        if not any(r.sampling_params.adjusts_logits for r in reqs):
            return logits
        out, row = logits.float().clone(), 0
        for r in reqs:
            n = len(r.draft_token_ids)
            if r.sampling_params.adjusts_logits:
                extras = [[r.draft_token_ids[i] for i in before] for before in draft_histories(n, r.draft_parents)]
                out[row : row + n + 1] = adjust_logits(logits[row : row + n + 1], r.sampling_params,
                                                       r.prompt_token_ids, r.output_token_ids, extras, r.eos_token_id,
                                                       r.bad_words_ids)
            row += n + 1
        return out

    def _chosen_tokens(self, reqs, logits: torch.Tensor):
        """The target's choice at every node (the last token and each draft, chain or tree), then
        a walk down each request's drafts (``tree_sampler``) -> (token_ids, num_accepted, paths;
        a path is None for a chain). A node at depth d picks output index num_output_tokens + d,
        with that index's keyed noise."""
        row_params, row_generators = [], []
        for r in reqs:
            n = len(r.draft_token_ids)
            depths = node_depths(r.draft_parents) if r.draft_parents is not None else range(1, n + 1)
            first = r.num_output_tokens
            row_params += [r.sampling_params] * (n + 1)
            row_generators += [keyed_generator(r.seed, first + d, CHOICE, logits.device) for d in (0, *depths)]
        choices = target_choices(logits, row_params, row_generators)    # the one host sync of the step
        token_ids, num_accepted, paths, row = [], [], [], 0
        for r in reqs:
            n = len(r.draft_token_ids)
            parents = r.draft_parents if r.draft_parents is not None else list(range(-1, n - 1))
            emitted, path = walk_tree(r.draft_token_ids, parents, choices[row : row + n + 1])
            token_ids.append(emitted)
            num_accepted.append(len(path))
            paths.append(path if r.draft_parents is not None else None)
            row += n + 1
        return token_ids, num_accepted, paths

    def _sampled_tokens(self, reqs, logits: torch.Tensor):
        """The rejection sampler over processed probabilities -> (token_ids [B][K+1], num_accepted
        [B], paths: all None). Each request draws from a generator keyed by the step's first
        output index: fresh numbers every step, the same ones if the step is verified again."""
        counts = [len(r.draft_token_ids) for r in reqs]
        params = [r.sampling_params for r in reqs]
        k = max(counts)
        batch = len(reqs)
        row_params = [p for p, n in zip(params, counts) for _ in range(n + 1)]
        st = SamplingTensors.build(row_params, self.vocab_size, self.device)
        probs = processed_probs(logits, st)                       # [R, V]
        # Scatter rows into the padded [B, K+1, V] layout.
        padded = probs.new_zeros(batch, k + 1, self.vocab_size)
        drafts = torch.zeros(batch, k, dtype=torch.long)
        row = 0
        draft_probs = None
        if any(getattr(r, "draft_probs", None) is not None for r in reqs):
            draft_probs = probs.new_zeros(batch, k, self.vocab_size)
        for b, r in enumerate(reqs):
            n = counts[b]
            padded[b, : n + 1] = probs[row : row + n + 1]
            row += n + 1
            if n:
                drafts[b, :n] = torch.tensor(r.draft_token_ids)
                if draft_probs is not None:
                    dp = r.draft_probs
                    if dp is None:  # a one-hot proposal inside a batch with probabilistic ones
                        draft_probs[b, torch.arange(n), drafts[b, :n]] = 1.0
                    else:
                        draft_probs[b, :n] = dp[:n]
        out = rejection_sample(
            padded,
            drafts.to(self.device),
            counts,
            draft_probs,
            [p.greedy for p in params],
            [keyed_generator(r.seed, r.num_output_tokens, REJECTION, logits.device) for r in reqs],
        )
        return out.token_ids.tolist(), out.num_accepted.tolist(), [None] * batch   # the one host sync of the step

    def _tree_rejection_tokens(self, reqs, logits: torch.Tensor):
        """Trees of sampled drafts with their q (``tree_sampler.walk_tree_rejection``) ->
        (token_ids, num_accepted, paths). One generator per request and step, keyed by the step's
        first output index, as the chain's rejection sampler."""
        counts = [len(r.draft_token_ids) for r in reqs]
        row_params = [r.sampling_params for r, n in zip(reqs, counts) for _ in range(n + 1)]
        probs = processed_probs(logits, SamplingTensors.build(row_params, self.vocab_size, self.device))   # [R, V]
        token_ids, num_accepted, paths, row = [], [], [], 0
        for r, n in zip(reqs, counts):
            generator = keyed_generator(r.seed, r.num_output_tokens, REJECTION, logits.device)
            emitted, path = walk_tree_rejection(r.draft_token_ids, r.draft_parents, probs[row : row + n + 1],
                                                r.draft_probs[:n].to(probs.device, probs.dtype), generator)
            token_ids.append(emitted)
            num_accepted.append(len(path))
            paths.append(path)
            row += n + 1
        return token_ids, num_accepted, paths

    def _greedy_tokens(self, reqs, logits: torch.Tensor):
        """All requests greedy: the rejection sampler's exact-match path, on the host.

        Each draft token is accepted while it equals the target's argmax at its
        position; the first mismatch (or the position after the last draft)
        emits the argmax. Skipping the probability tensors saves ~2-4 ms a step
        at batch 16 on CPU; the tokens are those of ``rejection_sample``'s
        greedy rows. -> (token_ids [B][accepted + 1], num_accepted [B]).
        """
        best = row_argmax(logits).tolist()     # [sum (n_i + 1)]: the one host sync of the step
        token_ids, num_accepted, row = [], [], 0
        for r in reqs:
            n = len(r.draft_token_ids)
            target = best[row : row + n + 1]
            accepted = 0
            while accepted < n and r.draft_token_ids[accepted] == target[accepted]:
                accepted += 1
            token_ids.append(target[: accepted + 1])
            num_accepted.append(accepted)
            row += n + 1
        return token_ids, num_accepted

    def _logprobs(self, reqs, logits, rows_per_req, rows_of_emitted, token_ids):
        """Log-probabilities (of the raw target distribution) of emitted tokens and top n."""
        out: list[list | None] = [None] * len(reqs)
        row = 0
        for b, r in enumerate(reqs):
            n_top = r.sampling_params.logprobs
            if n_top is not None:
                emitted = token_ids[b][: len(rows_of_emitted[b])]
                rows = torch.tensor([row + i for i in rows_of_emitted[b]], device=logits.device)
                out[b] = logprob_rows(self.tokenizer, logits.index_select(0, rows), emitted, n_top)
            row += rows_per_req[b]
        return out


# How a request's drafts are verified (``Verifier._sampled_or_chosen``).
CHOSEN, CHAIN_REJECTION, TREE_REJECTION = "chosen", "chain_rejection", "tree_rejection"


def rejection_sampled(req) -> bool:
    """An unseeded sampled request with a draft's probabilities (a chain, or a tree of sampled
    children): verified by rejection sampling, which accepts the most drafts. Every other request
    takes the target's choices (module docstring: a seeded request's tokens must not depend on its
    drafts)."""
    params = req.sampling_params
    return req.draft_probs is not None and not params.greedy and params.seed is None


def ends_at_leaf(req, num_accepted: int, tree_path: list[int] | None) -> bool:
    """Whether the step's last accepted node (the last token if none) has no draft
    below it: then the target's final token is a bonus, else a correction."""
    if req.draft_parents is None or tree_path is None:
        return num_accepted == len(req.draft_token_ids)
    last = tree_path[-1] if tree_path else -1
    return last not in req.draft_parents
