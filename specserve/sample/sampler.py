"""Logits -> processed probabilities -> tokens, keyed per request and output position, no host sync.

"Processed" means temperature, top-k, top-p and min-p applied, in that order
(the order vLLM and transformers use). Both the target's and a draft's
distributions go through ``processed_probs`` so rejection sampling compares
like with like. Greedy rows (temperature 0, or below
``GREEDY_TEMPERATURE`` = 1e-5) are processed at temperature 1; their tokens
come from the argmax, never from these probabilities.

Numerics that cannot produce garbage: the most likely token always survives
top-k (k >= 1) and top-p (rank 0 is never masked, even when ``top_p`` rounds
to 0 in float32), and min-p keeps the maximum, so every row keeps at least one
finite logit and its softmax is a distribution, never NaN.

Randomness: a sampled request's numbers come from ``keyed_generator(seed, j, purpose)``,
a generator of its own for each output index j, so output token j is decided by the same
numbers alone or in a batch, with any drafts before it, and after a preemption.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors: one row per logits row."""

    temperature: torch.Tensor   # [N] (greedy rows hold 1.0)
    top_k: torch.Tensor         # [N] (vocab size where disabled)
    top_p: torch.Tensor         # [N]
    min_p: torch.Tensor         # [N]
    need_sort: bool             # any row uses top-k or top-p
    need_min_p: bool
    max_top_k: int = 0          # the largest top-k below the vocabulary size (0: no row uses top-k)
    top_p_alone: bool = False   # some row uses top-p without top-k

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> "SamplingTensors":
        temps = [1.0 if p.greedy else p.temperature for p in params]
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            need_sort=any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p),
            need_min_p=any(m > 0 for m in min_p),
            max_top_k=max((k for k in top_k if k < vocab_size), default=0),
            top_p_alone=any(p < 1.0 and k == vocab_size for k, p in zip(top_k, top_p)),
        )


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [N, V] fp32 -> probabilities [N, V] after temperature/top-k/top-p/min-p."""
    logits = logits / st.temperature.unsqueeze(1)
    if st.need_sort:
        logits = top_k_top_p(logits, st)
    probs = logits.softmax(dim=-1)
    if st.need_min_p:
        threshold = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


# Ranks a CPU takes with torch.topk for a row with top-p and no top-k before it sorts the whole
# vocabulary: a real model's nucleus almost always lies within them.
TOP_P_HEAD = 1024


def top_k_top_p(logits: torch.Tensor, st: SamplingTensors, head: int = TOP_P_HEAD) -> torch.Tensor:
    """logits [N, V] -> the same with each row's tokens outside its top-k, then outside its top-p
    nucleus (of the top-k's renormalised probabilities), at -inf; rows with neither keep theirs.

    Only the leading ranks are ranked (``torch.topk``, sorted) where they decide every row:
    - a row with top-k needs its k best;
    - a row with top-p alone needs the ranks up to its nucleus's end. A CPU takes the ``head``
      best and checks that their mass reaches top_p (then every rank after is dropped); where
      one row's does not, all rows are ranked in full. A GPU ranks them in full at once: its
      sort is fast, and the check would stall the step until the host read it.
    A full sort of a 151,936-token row takes 13 ms on a 2-core CPU, its 1,024 best 0.9 ms.
    """
    vocab = logits.shape[-1]
    width = st.max_top_k
    if st.top_p_alone:
        width = max(width, head) if logits.device.type == "cpu" else vocab
    if width >= vocab:
        ranked, order = logits.sort(dim=-1, descending=True)               # [N, V]
    else:
        ranked, order = logits.topk(width, dim=-1)                         # [N, W], sorted
    ranks = torch.arange(ranked.shape[-1], device=logits.device)
    ranked = ranked.masked_fill(ranks[None, :] >= st.top_k[:, None], float("-inf"))
    # Each row's top-k mass, as a log: over the ranked tokens where they hold its top-k, over the
    # whole row where it has no top-k.
    log_mass = torch.where(st.top_k <= ranked.shape[-1], ranked.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    ranked_probs = (ranked - log_mass[:, None]).exp()                       # [N, W]
    # Drop a token when the tokens ranked above it already cover top_p; never the first one
    # (a top_p of 1e-300 is 0.0 in float32, and 0 >= 0). Rows without top-p drop nothing, even
    # where float32 sums reach 1.0 early: a row's distribution never depends on whether another
    # row of the batch asked for a sort.
    mass_through = ranked_probs.cumsum(dim=-1)
    uses_top_p = st.top_p < 1.0
    drop = (mass_through - ranked_probs >= st.top_p[:, None]) & (ranks[None, :] > 0) & uses_top_p[:, None]
    if ranked.shape[-1] < vocab and st.top_p_alone:
        # a row's unranked tokens are all dropped when its top-k is ranked, when its ranked mass
        # covers its top_p, or kept whole (by ``base`` below) when it has neither
        decided = (st.top_k <= ranked.shape[-1]) | (mass_through[:, -1] >= st.top_p) | ~uses_top_p
        if not bool(decided.all()):                     # some nucleus reaches past the head
            return top_k_top_p(logits, st, head=vocab)
    ranked = ranked.masked_fill(drop, float("-inf"))
    # Rows with top-k or top-p keep only what was ranked and kept; the others keep every token.
    filtered = (st.top_k < vocab) | uses_top_p
    base = logits.masked_fill(filtered[:, None], float("-inf"))
    return base.scatter(-1, order, ranked)


# What a request's random numbers decide. Every number a sampled request uses is drawn from a
# generator keyed by (the request's seed, an output index, one of these purposes), never from a
# running stream, so which numbers decide output token j does not depend on how the steps before
# it went: how many drafts they verified, whether the request was preempted and recomputed, which
# other requests shared its batch.
CHOICE = 0      # the exponential race that picks output token j: the target's choice, and a draft's guess of it
REJECTION = 1   # a rejection-sampling step whose first token is output j: its uniforms and residual noise
_NUM_PURPOSES = 2
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A bijective 64-bit mixer (Steele, Lea and Flood's SplitMix64 finalizer)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_generator(seed: int | None, index: int, purpose: int, device) -> torch.Generator | None:
    """The generator for output index ``index`` of the request seeded ``seed``, for ``purpose``
    (``CHOICE`` or ``REJECTION``); None for a greedy request (``seed`` None).

    The key is the mixed seed plus ``index * 2 + purpose``: the seeds of sample i and i + 1 of one
    request (seed, seed + 1) land far apart, and within one request every (index, purpose) gets
    its own key. PyTorch's CPU generator (mt19937) is seeded by the key's low 32 bits only; they
    still differ for every index of a request below 2^31.
    """
    if seed is None:
        return None
    key = (_splitmix64(seed) + index * _NUM_PURPOSES + purpose) & _MASK64
    return torch.Generator(device=device).manual_seed(key)


# Rows of float64 uniforms drawn before one batched log1p (64 MiB at most).
NOISE_CHUNK_ELEMENTS = 1 << 23


def exponential_noise(num_rows: int, vocab_size: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[num_rows, V] Exp(1) noise; row i drawn from generators[i] (None: global RNG).

    ``argmax(p / E)`` with E ~ Exp(1) is a sample from p (the exponential race),
    which needs no cumulative sum and no host sync. The noise is clamped away
    from 0: a zero would make ``0 / 0`` a NaN, which argmax picks, so a
    zero-probability token could win.

    Each row is ``-log1p(-u)`` of float64 uniforms u from its generator, rounded to float32:
    on a CPU exactly the numbers ``Tensor.exponential_`` draws from the same generator
    (tests/sample/test_sampler.py), in a third of the time, since only the uniforms are drawn
    row by row and the logarithm runs vectorised over many rows at once (0.27 against 0.80 ms
    for a 49,152-token row). float64 keeps the smallest values, which decide when a rare
    token wins, as fine as float32 can hold them.
    """
    noise = torch.empty(num_rows, vocab_size, device=device)
    chunk = max(1, min(num_rows, NOISE_CHUNK_ELEMENTS // max(1, vocab_size)))
    for start in range(0, num_rows, chunk):
        rows = generators[start : start + chunk]
        uniforms = torch.empty(len(rows), vocab_size, dtype=torch.float64, device=device)   # [rows, V]
        for j, gen in enumerate(rows):
            uniforms[j].uniform_(generator=gen)
        noise[start : start + len(rows)] = uniforms.neg_().log1p_().neg_()
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [...]: each row's index of its first maximum, as ``argmax(dim=-1)`` gives it
    (ties and NaN alike), through ``max``, which PyTorch's CPU kernels compute about three times
    faster (4.3 against 1.6 ms for 64 rows of 49,152 float32 logits on one thread)."""
    return x.max(dim=-1).indices


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs [N, V] -> tokens [N]."""
    noise = exponential_noise(probs.shape[0], probs.shape[1], generators, probs.device)
    return row_argmax(probs / noise)


@dataclass
class Choice:
    tokens: list[int]                 # [N] one token per row
    probs: torch.Tensor | None        # [N, V] every row's processed probabilities; None when all rows are greedy


def choose_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> Choice:
    """The one way specserve picks a token from a row of logits, wherever it does: the target's
    choice at every node of drafts, and each proposer's drafts. Greedy rows take the argmax;
    the others an exponential-race sample from their processed probabilities, drawn from the
    row's generator (so a row's token never depends on the other rows). The engine passes
    ``keyed_generator(seed, j, CHOICE)`` for a row that picks output token j, to the target
    and to the draft alike: the draft's guess of token j then races with the target's own noise,
    so it is accepted as often as that coupling allows, and the target's choice is the same
    whatever was drafted. logits [N, V] fp32 (bias and penalties already applied); one host sync."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return Choice(row_argmax(logits).tolist(), None)
    probs = processed_probs(logits, SamplingTensors.build(params, logits.shape[-1], logits.device))   # [N, V]
    if len(sampled) == len(params):   # no greedy row: no argmax over the logits
        return Choice(sample_from_probs(probs, generators).tolist(), probs)
    rows = torch.tensor(sampled, device=logits.device)
    drawn = sample_from_probs(probs.index_select(0, rows), [generators[i] for i in sampled])      # [S]
    tokens = row_argmax(logits).index_copy(0, rows, drawn)                                     # [N]
    return Choice(tokens.tolist(), probs)
