"""How many draft tokens each request gets this step: the k that maximizes tokens per second.

Two things are measured online, every step, from the engine's own timings:

- **cost**: the target forward's time as a line in the rows it verifies,
  ``t = fixed + per_row * rows`` (least squares over recent steps, older ones
  fading), and the proposer's time per draft position (a draft model runs one
  forward per position; n-gram lookup costs ~0);
- **acceptance**: for each request, the chance that its i-th draft token is
  accepted, ``r_i`` (accepted / drafted at position i: a chain accepts position
  i only if 1..i-1 were accepted too, so this is the chance of emitting it),
  from its own steps blended with the proposer's engine-wide figures as a prior.

A step with k_j drafts for request j emits ``sum_j (1 + r_j1 + ... + r_jk_j)``
tokens on average and costs ``fixed + per_row * sum_j (k_j + 1) + draft * max_j k_j``.
``choose`` tries every cap c in 0..K for the whole step, keeps the best ratio,
then trims each request's drafts whose ``r_ji`` is worth less than the rows they
cost at that ratio. k = 0 (plain decoding) is one of the choices, so under load
or with poor acceptance speculation switches itself off; every ``probe_every``-th
step of a request drafts the full K anyway, so its acceptance keeps being measured.

Nothing here touches tensors or the engine: the engine feeds timings and reads
choices (``LLMEngine._propose``), so the logic is tested with made-up costs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class LinearCost:
    """``y = fixed + slope * x`` fitted by least squares with exponential forgetting."""

    decay: float = 0.98
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n = self.n * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    def fit(self) -> tuple[float, float] | None:
        """(fixed, slope), or None before two distinct x have been seen."""
        if self.n < 2:
            return None
        var = self.sxx - self.sx * self.sx / self.n
        if var <= 1e-9 * max(self.sxx, 1.0):
            return None
        slope = (self.sxy - self.sx * self.sy / self.n) / var
        fixed = (self.sy - slope * self.sx) / self.n
        return max(fixed, 0.0), max(slope, 0.0)


@dataclass
class DraftLengthPolicy:
    """Per-step draft lengths from measured costs and acceptance (see the module docstring)."""

    max_k: int
    prior_weight: float = 4.0        # the engine-wide acceptance counts as this many of a request's steps
    probe_every: int = 16            # a request's every n-th decode step drafts max_k
    forward: LinearCost = field(default_factory=LinearCost)
    draft_seconds_per_position: float = 0.0
    steps_by_k: list[int] = field(default_factory=list)   # how often each k was chosen (index = k)

    def __post_init__(self) -> None:
        self.steps_by_k = [0] * (self.max_k + 1)

    # ---------------------------------------------------------------- measuring
    def record_forward(self, rows: int, seconds: float) -> None:
        self.forward.add(rows, seconds)

    def record_draft(self, positions: int, seconds: float) -> None:
        if positions > 0:
            per = seconds / positions
            a = 0.9 if self.draft_seconds_per_position else 0.0
            self.draft_seconds_per_position = a * self.draft_seconds_per_position + (1 - a) * per

    # ----------------------------------------------------------------- choosing
    def acceptance(self, accepted: Sequence[int], drafted: Sequence[int],
                   prior: Sequence[float]) -> list[float]:
        """r_1..r_max_k for one request: its own counts blended with ``prior``,
        positions never drafted extrapolated geometrically from the last two."""
        rates = []
        for i in range(self.max_k):
            own_a = accepted[i] if i < len(accepted) else 0
            own_d = drafted[i] if i < len(drafted) else 0
            p = prior[i] if i < len(prior) else None
            if p is None:
                if len(rates) >= 2 and rates[-2] > 0:
                    p = rates[-1] * min(1.0, rates[-1] / rates[-2])
                else:
                    p = rates[-1] * 0.8 if rates else 0.5
            rates.append((own_a + self.prior_weight * p) / (own_d + self.prior_weight))
        for i in range(1, len(rates)):           # emitting i needs i - 1 emitted: never more likely
            rates[i] = min(rates[i], rates[i - 1])
        return rates

    def choose(self, rates: Sequence[Sequence[float]], limits: Sequence[int], probe: Sequence[bool]) -> list[int]:
        """Draft tokens per request (at most ``limits[j]``), given each one's acceptance ``rates[j]``.

        Until the forward's cost line is known (two different row counts seen) every
        request drafts its limit."""
        fit = self.forward.fit()
        if fit is None or not rates:
            return list(limits)
        fixed, per_row = fit
        draft = self.draft_seconds_per_position
        best, best_ratio = 0, -1.0
        for cap in range(max(limits) + 1):
            ks = [min(cap, lim) for lim in limits]
            ratio = self._throughput(rates, ks, fixed, per_row, draft)
            if ratio > best_ratio * (1 + 1e-9):
                best, best_ratio = cap, ratio
        chosen = []
        for r, lim, is_probe in zip(rates, limits, probe):
            if is_probe:
                chosen.append(lim)
                continue
            k = min(best, lim)
            # A draft position pays when the tokens it adds beat what its row's time would earn.
            while k > 0 and r[k - 1] < best_ratio * per_row:
                k -= 1
            chosen.append(k)
        for k in chosen:
            self.steps_by_k[k] += 1
        return chosen

    @staticmethod
    def _throughput(rates, ks, fixed: float, per_row: float, draft: float) -> float:
        tokens = sum(1.0 + sum(r[:k]) for r, k in zip(rates, ks))
        seconds = fixed + per_row * sum(k + 1 for k in ks) + draft * max(ks, default=0)
        return tokens / seconds if seconds > 0 else 0.0
