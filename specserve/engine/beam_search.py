"""Beam search, exact, with and without speculation: the search over one pass's log-probabilities.

The semantics (``beam_search_params``' docstring): Hugging Face transformers' ``num_beams``
search without sampling. One *depth* is one token for every running beam:

1. each running beam b (cumulative log-probability s_b, in rank order) offers its 2B best
   tokens t with scores s_b + log p_b(t); all offers are ranked by score (ties: the better
   ranked beam, then the smaller token id) and the best 2B kept;
2. of those, the ones ranked below B that end (EOS unless ``ignore_eos``, or the
   ``max_tokens``-th token) join the finished hypotheses (the best B kept, scored
   s / generated_len ** length_penalty); the first B that do not end are the new running
   beams, best first;
3. the search is done at ``max_tokens``, or by ``early_stopping`` (params' docstring).

**With speculation.** Each running beam is verified like any decoding request: the target
computes, in ONE forward shared by every beam of every request in the step, its
distribution after its last token (row 0) and after each of its draft tokens (row 1 + i,
draft i's path to the beam's last token being the context: a chain, or a tree of drafts).
``run_pass`` then applies the depths above one after the other, as long as every running
beam's distribution is one of those rows:

- depth 0 always is: every running beam's row 0, computed after its own tokens;
- a new beam (root beam r, tokens t_1..t_j appended this pass) has its distribution for
  depth j computed iff t_1..t_j is a path of r's drafts (t_1 a child of r's last token,
  each next one a child of the one before): then the row of that path's last draft is
  exactly the distribution plain decoding would compute for the new beam, since the
  draft's K/V and attention mask give it the same context, token for token;
- as soon as one running beam is off its root's drafts, the pass ends after that depth:
  later depths wait for the next pass, which computes every beam's distribution again
  from its committed tokens (its last token first, then new drafts).

So every depth applied uses exactly the distributions plain beam search uses at that depth,
and the same selection: the beams, their order and their scores are plain beam search's,
bit for bit where a row's numbers do not depend on what else its forward holds (the CPU
default dtype: docs/architecture.md, "Row invariance"); elsewhere (float32 on MKL, GPUs) up to
near-ties, as greedy speculation is. A pass commits at least one depth, as a
plain step does; it commits more only while no beam leaves its root's drafts. Finished
hypotheses need no distribution, so a beam that ends (EOS) never stops a pass.

This module is the selection alone (no requests, no KV): ``engine.beam_groups`` runs it per
request and gives each new beam the K/V of its path (shared blocks, copies, moves).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.beam_search_params import BeamSearchParams


@dataclass
class Hypothesis:
    """A finished beam."""

    tokens: list[int]          # every generated token (the ending EOS included)
    logprobs: list[float]      # each token's log-probability
    cum_logprob: float
    score: float               # cum_logprob / len(tokens) ** length_penalty
    finish_reason: str         # "stop" (EOS) or "length" (max_tokens)


@dataclass
class PassBeam:
    """One running beam's share of a pass: its state and its verified rows."""

    tokens: list[int]                   # generated so far (before this pass)
    logprobs: list[float]               # theirs
    cum_logprob: float
    rows: torch.Tensor                  # [1 + len(drafts), V] logits: after its last token, then after draft i
    drafts: list[int] = field(default_factory=list)
    parents: list[int] | None = None    # a tree of drafts (parent of draft i, -1 = the last token); None: a chain

    def child(self, node: int, token: int) -> int | None:
        """The draft below ``node`` (-1: the beam's last token) that is ``token``, if any."""
        if self.parents is None:
            nxt = node + 1
            return nxt if nxt < len(self.drafts) and self.drafts[nxt] == token else None
        return next((i for i, (p, t) in enumerate(zip(self.parents, self.drafts)) if p == node and t == token), None)


@dataclass
class NewBeam:
    """A running beam after a pass: running beam ``root`` plus ``tokens``."""

    root: int                  # index of the PassBeam it extends
    tokens: list[int]          # appended this pass (one per committed depth)
    nodes: list[int]           # draft index of each of tokens[:-1]: the verified path its K/V follows
    logprobs: list[float]      # of ``tokens``
    cum_logprob: float


@dataclass
class PassResult:
    running: list[NewBeam]     # best first; empty when done
    depths: int                # depths committed (the tokens each new beam gained)
    done: bool


@dataclass
class _Frontier:
    beam: NewBeam
    node: int                  # the row holding its distribution: -1 (row 0) or a draft index


class BeamSearchState:
    """One request's search: its finished hypotheses and how many tokens its beams hold."""

    def __init__(self, params: BeamSearchParams, eos_token_id: int | None, max_tokens: int):
        self.params = params
        self.width = params.beam_width
        self.eos = None if params.ignore_eos else eos_token_id
        self.max_tokens = max_tokens          # params.max_tokens, capped by the model's length
        self.finished: list[Hypothesis] = []  # best first, at most ``width``
        self.num_generated = 0                # tokens each running beam holds
        self.done = False

    def run_pass(self, beams: list[PassBeam]) -> PassResult:
        """Apply depths while every running beam's distribution is verified (module docstring)."""
        cache: dict[tuple[int, int], tuple[list[float], list[int]]] = {}

        def top(beam: int, row: int) -> tuple[list[float], list[int]]:
            """A row's 2B best tokens and log-probabilities, computed when a depth needs them (a
            tree's rows mostly are not); a row's numbers never depend on the rows beside it."""
            if (beam, row) not in cache:
                lp = torch.log_softmax(beams[beam].rows[row].float(), dim=-1)           # [V]
                best = torch.topk(lp, min(2 * self.width, lp.shape[-1]))
                cache[(beam, row)] = (best.values.tolist(), best.indices.tolist())
            return cache[(beam, row)]

        frontier = [_Frontier(NewBeam(i, [], [], [], b.cum_logprob), -1) for i, b in enumerate(beams)]
        depth = 0
        while True:
            running = self._depth(frontier, top, beams)
            depth += 1
            if self.done or not running:
                self.done = True
                return PassResult([], depth, True)
            nodes = [beams[nb.root].child(f_node, nb.tokens[-1]) for nb, f_node in running]
            if any(n is None for n in nodes):
                return PassResult([nb for nb, _ in running], depth, False)
            for (nb, _), n in zip(running, nodes):
                nb.nodes.append(n)
            frontier = [_Frontier(nb, n) for (nb, _), n in zip(running, nodes)]

    def _depth(self, frontier: list[_Frontier], top, beams: list[PassBeam]) -> list[tuple[NewBeam, int]]:
        """One depth: (new running beam, the node its parent's distribution came from), best first."""
        width = self.width
        offers = []   # (score, parent rank, token, logprob)
        for rank, f in enumerate(frontier):
            values, ids = top(f.beam.root, f.node + 1)
            offers += [(f.beam.cum_logprob + v, rank, t, v) for v, t in zip(values, ids)]
        offers.sort(key=lambda o: (-o[0], o[1], o[2]))
        generated = self.num_generated + 1
        at_length = generated >= self.max_tokens
        running = []
        for r, (score, rank, token, logprob) in enumerate(offers[: 2 * width]):
            parent = frontier[rank]
            ends = at_length or token == self.eos
            if ends:
                if r < width:
                    self._finish(beams[parent.beam.root], parent.beam, token, logprob, score, at_length, generated)
            elif len(running) < width:
                nb = parent.beam
                running.append((NewBeam(nb.root, nb.tokens + [token], list(nb.nodes), nb.logprobs + [logprob], score),
                                parent.node))
        self.num_generated = generated
        self.done = at_length or self._stops(running)
        return running

    def _finish(self, root: PassBeam, beam: NewBeam, token: int, logprob: float, score: float, at_length: bool,
                generated: int) -> None:
        hyp = Hypothesis(root.tokens + beam.tokens + [token], root.logprobs + beam.logprobs + [logprob], score,
                         score / generated ** self.params.length_penalty,
                         "stop" if token == self.eos else "length")
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)     # stable: an earlier hypothesis wins a tie
        del self.finished[self.width:]

    def _stops(self, running: list[tuple[NewBeam, int]]) -> bool:
        """After a depth: can the running beams still beat the worst of ``width`` finished ones?"""
        p = self.params
        if not running:
            return True
        if len(self.finished) < self.width:
            return False
        if p.early_stopping is True:
            return True
        length = self.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else self.num_generated
        best_possible = running[0][0].cum_logprob / length ** p.length_penalty
        return best_possible <= self.finished[-1].score

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first."""
        return list(self.finished)
