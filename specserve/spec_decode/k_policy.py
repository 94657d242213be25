"""How many draft tokens each request gets this step: the k that maximizes tokens per second.

Two things are measured online, every step, from the engine's own timings:

- **cost**: the target forward's time by the number of rows it verifies
  (``RowCost``: its shape over 1..K+1 rows timed at start-up, scaled by every
  verification step's timing; larger row counts measured as they occur),
  and the proposer's time for k drafts (``DraftCost``: a draft model runs one forward per
  position, the first over the tokens it catches up; n-gram lookup costs ~0);
- **acceptance**: for each request, the chance that its i-th draft token is
  accepted, ``r_i`` (accepted / drafted at position i: a chain accepts position
  i only if 1..i-1 were accepted too, so this is the chance of emitting it),
  from its own steps blended with the proposer's engine-wide figures as a prior.

A step with k_j drafts for request j emits ``sum_j (1 + r_j1 + ... + r_jk_j)``
tokens on average and costs ``forward(sum_j (k_j + 1)) + draft(max_j k_j) + overhead``
(overhead: the rest of a decode step, scheduling, sampling and output, also measured).
``choose`` tries every cap c in 0..K for the whole step, keeps the best ratio,
then trims each request's last drafts while that raises the step's expected
tokens per second. k = 0 (plain decoding) is one of the choices, so under load
or with poor acceptance speculation switches itself off; a request's decode steps
16, 32, 64, ... may draft the full K anyway (probes), so its acceptance keeps being measured.

A probe is not free where the draft keeps its own KV (draft model, EAGLE): a draft that
sat steps out first catches up on every token since it last ran, the prompt too on a
request's first probe. ``probe_pays`` lets a probe run only where it could pay for that:
had the probe accepted every draft, drafting would then pay, and the tokens the request
may still emit, each made that much cheaper, repay the probe's catch-up and drafts.
(On Qwen2.5-Coder-1.5B with int8 activations on an AVX2 CPU a 70-token catch-up of the
0.5B draft costs 0.6 s, about ten decode steps: docs/speculative_decoding.md.)

Nothing here touches tensors or the engine: the engine feeds timings and reads
choices (``LLMEngine._propose``), so the logic is tested with made-up costs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import zip_longest


@dataclass
class RowCost:
    """Seconds of a target forward by the number of rows it verifies, measured.

    Not a line: on a CPU the matmul kernels take rows in groups (one row, a fused
    path for a few, tiles beyond), each with its own cost per row (measured,
    docs/speculative_decoding.md). Two sources:

    - ``shape``: the row counts timed at start-up (``calibrate``). Later timings of
      those counts move one ``scale`` for all of them (a longer context, a busier
      machine slow every row count alike), so a count the policy stopped choosing
      never goes stale at a figure of the past; each timing also moves its own
      count's shape, more slowly (``shape_weight``), so a start-up timing that came
      out high or low on a noisy machine is corrected once the policy uses that count
      (on Qwen2.5-Coder-1.5B the 3-row figure once read 7% above what its steps took:
      docs/benchmarks.md, "Is the cost model right on Qwen2.5-Coder-1.5B?");
    - ``seconds``: row counts beyond the calibrated ones (larger batches), each a
      moving average of its own timings.

    A count never measured is interpolated between its measured neighbours, or
    extended from the last two beyond them; no count is read as cheaper than a
    smaller one.
    """

    weight: float = 0.2          # of a new measurement in the moving averages
    shape_weight: float = 0.05   # of a calibrated count's new measurement in its own shape
    shape: dict[int, float] = field(default_factory=dict)
    scale: float = 1.0
    seconds: dict[int, float] = field(default_factory=dict)

    def calibrate(self, rows: int, seconds: float) -> None:
        self.shape[rows] = seconds / self.scale

    def add(self, rows: int, seconds: float) -> None:
        if rows in self.shape:
            self.scale = (1 - self.weight) * self.scale + self.weight * seconds / self.shape[rows]
            self.shape[rows] += self.shape_weight * (seconds / self.scale - self.shape[rows])
            return
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else (1 - self.weight) * old + self.weight * seconds

    def known(self) -> bool:
        return len(self.shape) + len(self.seconds) >= 2

    def points(self) -> dict[int, float]:
        return {**{r: t * self.scale for r, t in self.shape.items()}, **self.seconds}

    def __call__(self, rows: int) -> float:
        points = self.points()
        cost = max([t for r, t in points.items() if r < rows] + [_interpolate(points, rows)])
        # Past some counts a row costs at least EXTRAPOLATED_ROW_SHARE of that count's average row:
        # - past every measured count: two close counts (4 and 5 rows, inside one fused kernel
        #   call) can cost alike, and their slope carried out to a batch of 32 would make every
        #   draft look free until a step had paid for the mistake;
        # - past any count measured online beyond the calibrated ones (larger batches): those are
        #   averages of the steps that chose them, so a count that once measured low keeps being
        #   chosen and one that measured high is not measured again; they lean low (at batch 32,
        #   36 rows read 0.25 of an average row dearer than 32, where 0.75 is measured).
        largest, top = max(points), max(self.shape, default=None)
        floors = [t * (1 + EXTRAPOLATED_ROW_SHARE * (rows - r) / r) for r, t in points.items()
                  if r < rows and (r == largest or (top is not None and r > top))]
        return max([cost, *floors])


def _interpolate(points: dict[int, float], rows: int) -> float:
    if rows in points:
        return points[rows]
    xs = sorted(points)
    below = [x for x in xs if x < rows]
    above = [x for x in xs if x > rows]
    if below and above:
        a, b = below[-1], above[0]
        return points[a] + (points[b] - points[a]) * (rows - a) / (b - a)
    a, b = (xs[-2], xs[-1]) if below else (xs[0], xs[1])
    slope = max((points[b] - points[a]) / (b - a), 0.0)   # past the largest count, RowCost adds a floor
    return max(points[b if below else a] + slope * (rows - (b if below else a)), 1e-9)


# Measured on the default model (2 threads): past 8 rows a verified row costs 0.5-0.8 of the
# average row at the count below it (after the row-tile fix, context 120: batch 8 0.52-0.70,
# batch 32 0.74-0.78, batch 64 0.79 for four rows; docs/benchmarks.md, dynamic_k at batch 8/32/64).
EXTRAPOLATED_ROW_SHARE = 0.75

@dataclass
class DraftCost:
    """Seconds of a proposal of k drafts: a first forward over the tokens caught up, then k - 1
    forwards of one token each, plus ``per_catch_up_row`` for each token a request catches up
    beyond what one verification emits (``DraftLengthPolicy.extra_catch_up``).

    A draft model's forwards are timed at start-up (``calibrate``; a proposer without a runner
    of its own, EAGLE, starts from its first steady proposal, all positions alike). A steady
    proposal's timing moves one ``scale`` for ``first`` and ``later`` (on Qwen2.5-Coder-0.5B with
    int8 activations on an AVX2 CPU, a 1-draft proposal costs 31 ms and a 4-draft one 25 ms a
    draft: one figure per position could not tell them apart); a proposal that caught up more
    moves ``per_catch_up_row`` with what it took beyond its steady cost."""

    first: float = 0.0
    later: float = 0.0
    per_catch_up_row: float = 0.0
    scale: float = 1.0
    weight: float = 0.1          # of a new timing in the moving averages

    def calibrate(self, first: float, later: float, per_catch_up_row: float) -> None:
        self.first, self.later, self.per_catch_up_row, self.scale = first, later, per_catch_up_row, 1.0

    def __call__(self, positions: int, catch_up_rows: int = 0) -> float:
        if positions <= 0:
            return 0.0
        return self.scale * (self.first + self.later * (positions - 1)) + self.per_catch_up_row * catch_up_rows

    def record(self, positions: int, seconds: float, catch_up_rows: int = 0) -> None:
        if positions <= 0:
            return
        steady = self(positions)
        if catch_up_rows > 0:
            if steady:
                per_row = max(seconds - steady, 0.0) / catch_up_rows
                w = self.weight if self.per_catch_up_row else 1.0
                self.per_catch_up_row += w * (per_row - self.per_catch_up_row)
        elif not steady:
            self.first = self.later = seconds / positions
        else:
            self.scale += self.weight * (self.scale * seconds / steady - self.scale)


@dataclass
class DraftLengthPolicy:
    """Per-step draft lengths from measured costs and acceptance (see the module docstring)."""

    max_k: int
    prior_weight: float = 4.0        # the engine-wide acceptance counts as this many of a request's steps
    probe_every: int = 16            # a request's decode steps 16, 32, 64, 128, ... draft their limit
    forward: RowCost = field(default_factory=RowCost)
    draft: DraftCost = field(default_factory=DraftCost)
    overhead_seconds: float = 0.0    # the rest of a decode step: scheduling, sampling, output (moving average)
    steps_by_k: list[int] = field(default_factory=list)   # how often each k was chosen (index = k)

    def __post_init__(self) -> None:
        self.steps_by_k = [0] * (self.max_k + 1)

    # ---------------------------------------------------------------- measuring
    def record_forward(self, rows: int, seconds: float) -> None:
        self.forward.add(rows, seconds)

    def calibrate_forward(self, rows: int, seconds: float) -> None:
        self.forward.calibrate(rows, seconds)

    def record_draft(self, positions: int, seconds: float, catch_up_rows: int = 0) -> None:
        """A proposal of ``positions`` drafts that took ``seconds``, having caught up
        ``catch_up_rows`` tokens beyond the steady ones (``extra_catch_up``, summed over requests)."""
        self.draft.record(positions, seconds, catch_up_rows)

    def extra_catch_up(self, tokens: int) -> int:
        """Of the ``tokens`` a proposer catches up for a request, those beyond what one verification
        emits (K + 1): what a request's idle steps (k = 0) left it to read."""
        return max(tokens - (self.max_k + 1), 0)

    def is_probe_step(self, step: int) -> bool:
        """Probes back off (steps 16, 32, 64, ...): a request whose drafts do not pay loses
        little to them, and one that starts paying is found again."""
        return step >= self.probe_every and step % self.probe_every == 0 and (step & (step - 1)) == 0

    def probe_pays(self, accepted: Sequence[int], drafted: Sequence[int], prior: Sequence[float],
                   remaining_tokens: int, catch_up_rows: int) -> bool:
        """Whether a request's probe step could pay for itself (batch-1 costs).

        Optimistically, the probe accepts all its drafts (one more accepted draft at each
        position of the request's counts). With that acceptance the best chain costs ``best``
        a token against plain decoding's ``plain``; the probe pays only if the
        ``remaining_tokens`` the request may still emit, each ``plain - best`` cheaper, repay
        what the probe adds to a plain step: its ``catch_up_rows`` (``extra_catch_up``), its
        drafts and its K more verified rows. Before the engine has measured any acceptance
        (an empty ``prior``) the optimism is perfect acceptance; before it has measured the
        forward's cost every probe runs."""
        if not self.forward.known():
            return True
        ones = [1] * self.max_k
        prior = prior or [1.0] * self.max_k
        optimistic = self.acceptance([a + b for a, b in zip_longest(accepted, ones, fillvalue=0)],
                                     [d + b for d, b in zip_longest(drafted, ones, fillvalue=0)], prior)
        plain = self.forward(1) + self.overhead_seconds
        emitted = [1.0 + t for t in _cumsum(optimistic)]          # emitted[k - 1]: tokens a k-draft step emits
        best = min((self.forward(k + 1) + self.draft(k) + self.overhead_seconds) / emitted[k - 1]
                   for k in range(1, self.max_k + 1))
        if best >= plain:
            return False
        added = self.draft(self.max_k, catch_up_rows) + self.forward(self.max_k + 1) - self.forward(1)
        return remaining_tokens * (plain - best) > added

    def record_overhead(self, seconds: float) -> None:
        a = 0.9 if self.overhead_seconds else 0.0
        self.overhead_seconds = a * self.overhead_seconds + (1 - a) * max(seconds, 0.0)

    # ----------------------------------------------------------------- choosing
    @staticmethod
    def prior(accepted: Sequence[int], drafted: Sequence[int]) -> list[float]:
        """The engine-wide acceptance by position from its counts, (a + 1) / (d + 2): the few
        drafts of one probe are not read as certain (1 of 1 accepted reads 0.67, not 1.0)."""
        return [(a + 1) / (d + 2) for a, d in zip(accepted, drafted)]

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

        Until the forward's cost has been measured at two row counts every request
        drafts its limit."""
        if not self.forward.known() or not rates:
            return list(limits)
        prefix = [[0.0] + list(_cumsum(r[:lim])) for r, lim in zip(rates, limits)]

        def throughput(tokens: float, rows: int, longest: int) -> float:
            return tokens / (self.forward(rows) + self.draft(longest) + self.overhead_seconds)

        best, best_ratio = 0, -1.0
        for cap in range(max(limits) + 1):
            ks = [min(cap, lim) for lim in limits]
            ratio = throughput(sum(1.0 + p[k] for p, k in zip(prefix, ks)), sum(k + 1 for k in ks), max(ks))
            if ratio > best_ratio * (1 + 1e-9):
                best, best_ratio = cap, ratio
        chosen = [lim if is_probe else min(best, lim) for lim, is_probe in zip(limits, probe)]
        # Trim each request's last drafts while the step's expected tokens per second rise.
        tokens = sum(1.0 + p[k] for p, k in zip(prefix, chosen))
        rows = sum(k + 1 for k in chosen)
        longest = max(chosen)
        current = throughput(tokens, rows, longest)
        for j, is_probe in enumerate(probe):
            while chosen[j] > 0 and not is_probe:
                k = chosen[j]
                trimmed = throughput(tokens - prefix[j][k] + prefix[j][k - 1], rows - 1, longest)
                if trimmed <= current:
                    break
                tokens, rows, current, chosen[j] = tokens - prefix[j][k] + prefix[j][k - 1], rows - 1, trimmed, k - 1
        for k in chosen:
            self.steps_by_k[k] += 1
        return chosen


def _cumsum(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out
