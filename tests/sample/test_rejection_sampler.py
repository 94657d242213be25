"""The batched rejection sampler against a small one-request reference (the
gpt-fast ``speculative_decode`` loop), and the statistical test of losslessness:
the emitted tokens are distributed as the target's p, whatever q drafted them.

Randomness: the reference draws its own uniforms and samples with multinomial,
so it only has to agree with the batched sampler where the outcome is certain
(greedy rows, p(x) >= q(x), p(x) = 0, one-point residuals and bonus
distributions). One test also feeds it the batched sampler's documented draws
(per request: its num_draft uniforms, then V exponentials) to compare random
rows token for token.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from specserve.sample.rejection_sampler import rejection_sample
from specserve.sample.sampler import SamplingTensors, processed_probs
from specserve.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------- the reference


def reference_rejection_sample(p, drafts, q, greedy, gen=None, draws=None):
    """One request, loops. p [n+1, V] target probs; drafts: n token ids; q [n, V]
    draft probs or None (a proposer without probabilities: q = one-hot(draft)).
    ``draws = (uniforms [n], exponentials [V])`` replaces the request's own randomness.
    Returns (emitted tokens, number of accepted drafts)."""
    n, vocab = len(drafts), p.shape[-1]
    if greedy:
        for i, x in enumerate(drafts):
            best = int(p[i].argmax())
            if x != best:
                return drafts[:i] + [best], i
        return drafts + [int(p[n].argmax())], n
    if q is None:
        q = F.one_hot(torch.tensor(drafts, dtype=torch.long), vocab).float() if n else p.new_zeros(0, vocab)
    if draws is None:
        u = torch.rand(n, generator=gen)
        sample = lambda dist: int(torch.multinomial(dist, 1, generator=gen))  # noqa: E731
    else:
        u, noise = draws
        sample = lambda dist: int((dist / noise).argmax())  # noqa: E731
    for i, x in enumerate(drafts):
        ratio = p[i, x] / q[i, x] if q[i, x] > 0 else math.inf
        if u[i] < min(1.0, float(ratio)):
            continue                                          # accepted
        residual = (p[i] - q[i]).clamp(min=0)                # recovered token
        if residual.sum() == 0:
            residual = p[i]
        return drafts[:i] + [sample(residual / residual.sum())], i
    return drafts + [sample(p[n])], n                        # bonus token


def run_batched(rows, generators=None, garbage_seed=0):
    """Pad one-request rows into the batched layout (padding filled with garbage
    that must be ignored) and call rejection_sample.
    rows: dicts with p [n+1, V], drafts (n ints), q [n, V] or None, greedy."""
    g = torch.Generator().manual_seed(garbage_seed)
    batch, vocab = len(rows), rows[0]["p"].shape[-1]
    k = max(len(r["drafts"]) for r in rows)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g), dim=-1)
    drafts = torch.randint(0, vocab, (batch, k), generator=g)
    any_q = any(r["q"] is not None for r in rows)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=g), dim=-1) if any_q else None
    for b, r in enumerate(rows):
        n = len(r["drafts"])
        target[b, : n + 1] = r["p"]
        if n:
            drafts[b, :n] = torch.tensor(r["drafts"])
            if any_q:
                draft_probs[b, :n] = r["q"] if r["q"] is not None else F.one_hot(drafts[b, :n], vocab).float()
    num_draft = torch.tensor([len(r["drafts"]) for r in rows])
    gens = generators if generators is not None else [None] * batch
    out = rejection_sample(target, drafts, num_draft, draft_probs, [r["greedy"] for r in rows], gens)
    result = []
    for b in range(batch):
        acc = int(out.num_accepted[b])
        toks = out.token_ids[b].tolist()
        assert all(t >= 0 for t in toks[: acc + 1]) and all(t == -1 for t in toks[acc + 1 :])
        result.append((toks[: acc + 1], acc))
    return result


def softmax_rows(n, vocab, gen, scale=2.0):
    return torch.softmax(torch.randn(n, vocab, generator=gen) * scale, dim=-1)


# ---------------------------------------------------------------------------- deterministic


V = 12


def greedy_row(n, j, gen):
    """Greedy row whose first j drafts equal the argmax and the (j+1)-th does not."""
    p = softmax_rows(n + 1, V, gen)
    drafts = torch.randint(0, V, (n,), generator=gen).tolist()
    for i in range(n):
        best = int(p[i].argmax())
        if i < j:
            drafts[i] = best
        elif i == j:
            drafts[i] = (best + 1 + drafts[i] % (V - 1)) % V
    expected = drafts[:j] + [int(p[j].argmax())]
    return dict(p=p, drafts=drafts, q=None, greedy=True), expected


def certain_random_row(n, j, with_q, gen):
    """Random row whose outcome is certain: drafts 1..j have p(x) >= q(x) (accepted
    with probability 1), draft j+1 has p(x) = 0 and a one-point residual at y;
    if j == n the bonus distribution is a point mass at z."""
    q = softmax_rows(n, V, gen, scale=1.0) if with_q else None
    drafts = torch.randint(0, V, (n,), generator=gen).tolist()
    p = softmax_rows(n + 1, V, gen)                 # positions after j are never read
    for i in range(min(j, n)):
        if q is None:
            p[i] = F.one_hot(torch.tensor(drafts[i]), V).float()
        else:
            p[i] = q[i] + 0.5 * F.one_hot(torch.tensor(drafts[i]), V)
            p[i] /= p[i].sum()                       # p(x) = (q(x) + .5) / 1.5 >= q(x)
    if j < n:
        x = drafts[j]
        y = (x + 1 + int(torch.randint(0, V - 1, (1,), generator=gen))) % V
        if q is None:
            p[j] = F.one_hot(torch.tensor(y), V).float()
        else:
            p[j] = q[j].clone()                      # p - q is 0 except -q(x) at x and +q(x) at y
            p[j, y] += p[j, x]
            p[j, x] = 0.0
        last = y
    else:
        last = int(torch.randint(0, V, (1,), generator=gen))
        p[n] = F.one_hot(torch.tensor(last), V).float()
    return dict(p=p, drafts=drafts, q=q, greedy=False), drafts[:j] + [last]


def test_greedy_accepts_while_draft_is_argmax_then_emits_argmax():
    gen = torch.Generator().manual_seed(0)
    cases = [greedy_row(n, j, gen) for n in range(5) for j in range(n + 1) for _ in range(3)]
    rows, expected = zip(*cases)
    got = run_batched(list(rows))
    for row, want, (toks, acc) in zip(rows, expected, got):
        assert toks == want and acc == len(want) - 1
        assert reference_rejection_sample(row["p"], row["drafts"], None, True) == (want, len(want) - 1)


def test_greedy_all_accepted_gets_the_bonus():
    p = torch.eye(V)[[3, 5, 7, 9]]                     # argmax 3, 5, 7, then bonus 9
    (toks, acc), = run_batched([dict(p=p, drafts=[3, 5, 7], q=None, greedy=True)])
    assert toks == [3, 5, 7, 9] and acc == 3
    (toks, acc), = run_batched([dict(p=p, drafts=[3, 6, 7], q=None, greedy=True)])
    assert toks == [3, 5] and acc == 1


@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot", "draft-probs"])
def test_random_rows_with_certain_outcomes(with_q):
    gen = torch.Generator().manual_seed(1)
    cases = [certain_random_row(n, j, with_q, gen) for n in range(5) for j in range(n + 1) for _ in range(3)]
    rows, expected = zip(*cases)
    torch.manual_seed(0)
    got = run_batched(list(rows))
    for row, want, (toks, acc) in zip(rows, expected, got):
        assert toks == want and acc == len(want) - 1
        ref = reference_rejection_sample(row["p"], row["drafts"], row["q"], False, gen=gen)
        assert ref == (want, len(want) - 1)


def test_mixed_greedy_and_random_rows_with_variable_num_draft():
    gen = torch.Generator().manual_seed(2)
    cases = []
    for i in range(120):
        n = int(torch.randint(0, 6, (1,), generator=gen))    # 0..5 drafts, K = 5 for the batch
        j = int(torch.randint(0, n + 1, (1,), generator=gen))
        kind = i % 3
        cases.append(greedy_row(n, j, gen) if kind == 0 else certain_random_row(n, j, kind == 2, gen))
    rows, expected = zip(*cases)
    torch.manual_seed(0)
    batched = run_batched(list(rows), garbage_seed=7)
    assert {len(r["drafts"]) for r in rows} == set(range(6))
    for row, want, got in zip(rows, expected, batched):
        assert got == (want, len(want) - 1)
    # Each row alone (its own K) gives the same.
    for row, want in list(zip(rows, expected))[:30]:
        assert run_batched([row], garbage_seed=3) == [(want, len(want) - 1)]


def test_no_drafts_at_all_is_plain_sampling():
    p = torch.eye(V)[[4, 8]].unsqueeze(1)                # [2, 1, V]: K = 0
    out = rejection_sample(p, torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]), None, [True, False], [None, None])
    assert out.token_ids.tolist() == [[4], [8]] and out.num_accepted.tolist() == [0, 0]
    probs = torch.softmax(torch.randn(1, 1, V), dim=-1).expand(4000, 1, V)
    torch.manual_seed(0)
    out = rejection_sample(probs, torch.zeros(4000, 0, dtype=torch.long), torch.zeros(4000, dtype=torch.long),
                           None, [False] * 4000, [None] * 4000)
    assert len(set(out.token_ids[:, 0].tolist())) > 3       # it samples, it does not take the argmax


def test_random_rows_match_reference_given_the_same_draws():
    """Seeded rows, non-trivial p and q: feed the reference the draws the batched
    sampler makes from each request's generator (its num_draft uniforms, then V
    exponentials) and compare token for token."""
    gen = torch.Generator().manual_seed(3)
    rows, seeds = [], []
    for i in range(300):
        n = int(torch.randint(0, 4, (1,), generator=gen))
        p = softmax_rows(n + 1, V, gen, scale=1.0)
        mode = i % 3
        if mode == 0:
            q = None
            drafts = torch.randint(0, V, (n,), generator=gen).tolist()
        else:
            q = softmax_rows(n, V, gen, scale=1.0) if mode == 1 else (0.7 * p[:n] + 0.3 * softmax_rows(n, V, gen))
            drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist() if n else []
        rows.append(dict(p=p, drafts=drafts, q=q, greedy=(i % 7 == 0)))
        seeds.append(1000 + i)
    got = run_batched(rows, generators=[torch.Generator().manual_seed(s) for s in seeds])
    num_rejected = 0
    for row, seed, (toks, acc) in zip(rows, seeds, got):
        twin = torch.Generator().manual_seed(seed)
        n = len(row["drafts"])
        u = torch.empty(n).uniform_(generator=twin)
        noise = torch.empty(V).exponential_(generator=twin)
        ref = reference_rejection_sample(row["p"], row["drafts"], row["q"], row["greedy"], draws=(u, noise))
        assert (toks, acc) == ref
        num_rejected += acc < n
    assert num_rejected > 50                            # recovered tokens were exercised


def test_seeded_row_does_not_depend_on_its_neighbours_draft_counts():
    """A seeded request gives the same tokens alone or next to requests with more drafts."""
    gen = torch.Generator().manual_seed(4)
    p = softmax_rows(3, V, gen, scale=1.0)
    q = softmax_rows(2, V, gen, scale=1.0)
    for n in (0, 1, 2):
        row = dict(p=p[: n + 1], drafts=[1, 2][:n], q=q[:n] if n else None, greedy=False)
        other = dict(p=softmax_rows(6, V, gen), drafts=[0, 1, 2, 3, 4], q=softmax_rows(5, V, gen), greedy=False)
        for seed in range(8):
            alone = run_batched([row], generators=[torch.Generator().manual_seed(seed)])
            in_batch = run_batched([other, row], generators=[torch.Generator().manual_seed(99),
                                                             torch.Generator().manual_seed(seed)])
            assert alone[0] == in_batch[1], (n, seed)


# ---------------------------------------------------------------------------- statistics

DELTA = 1e-6   # allowed false-failure probability of each TV check


def tv_bound(p: torch.Tensor, n: int) -> float:
    """A bound the TV distance of n i.i.d. samples from p exceeds with probability <= DELTA.

    E[TV] = 1/2 sum_i E|c_i/n - p_i| <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen), and
    one sample moves TV by at most 1/n, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 n t^2).
    For V <= 50 and n = 9,000 rows of one (p, q) pair this is at most
    0.5 * sqrt(50 / n) + 0.028 = 0.065 (0.04 to 0.055 for the p used here), while the
    wrong samplers below reach TV 0.08 to 0.9. A flat "TV < 0.01 at 100k samples" would
    leave no margin: for a flat p over 50 tokens E[TV] is already about 0.009 there.
    """
    p = p.double()
    return 0.5 * (p * (1 - p) / n).sqrt().sum().item() + math.sqrt(math.log(1 / DELTA) / (2 * n))


def pearson(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom over the tokens with p > 0 (the
    support is checked separately); cells expecting fewer than 5 are pooled."""
    support = p > 0
    counts, expected = counts[support].double(), p[support].double() / p[support].double().sum() * counts.sum()
    order = expected.argsort()
    counts, expected = counts[order], expected[order]
    cut = 0                                     # pool the smallest cells until the pool expects >= 5
    while cut < len(expected) - 1 and (expected[:cut].sum() < 5 or expected[cut] < 5):
        cut += 1
    if cut:
        counts = torch.cat([counts[:cut].sum(0, keepdim=True), counts[cut:]])
        expected = torch.cat([expected[:cut].sum(0, keepdim=True), expected[cut:]])
    return ((counts - expected) ** 2 / expected).sum().item(), len(expected) - 1


def random_case(gen, vocab, k, kind):
    """Per-position target p [k+1, V] and draft q [k, V] (None: one-hot proposer)."""
    logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    p = torch.softmax(logits, dim=-1)
    if kind == "independent":
        q = softmax_rows(k, vocab, gen, scale=1.5)
    elif kind == "close":
        q = torch.softmax(logits[:k] + 0.7 * torch.randn(k, vocab, generator=gen), dim=-1)
    elif kind == "q_sparse":                       # the draft's support misses tokens p likes
        q = softmax_rows(k, vocab, gen, scale=1.5)
        q[:, : vocab // 3] = 0
        q /= q.sum(-1, keepdim=True)
    elif kind == "p_sparse":                       # drafts the target can never emit (top-k'd target)
        q = softmax_rows(k, vocab, gen, scale=1.0)
        p[:, vocab // 2 :] = 0
        p /= p.sum(-1, keepdim=True)
    elif kind == "equal":                          # q == p: everything accepted, bonus from p_{k+1}
        q = p[:k].clone()
    else:
        q = None
    return p, q


CASE_KINDS = ["independent", "close", "q_sparse", "p_sparse", "equal", "one_hot"]


def make_cases(seed=0):
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for i, kind in enumerate(CASE_KINDS):
        for k in (1, 3):
            vocab = int(torch.randint(10, 51, (1,), generator=gen))
            cases.append((kind, k, *random_case(gen, vocab, k, kind)))
    return cases


def check_lossless(sampler, cases, n=9_000, seed=0, min_total=0):
    """Run ``sampler`` on n rows per (p, q) case, drafts drawn from q, and compare the
    first emitted token with p_1 and the second (rows that accepted draft 1) with p_2.

    Returns failure messages: per-case TV above ``tv_bound``, tokens outside p's
    support, or a pooled chi-square over every case and position with p-value < 1e-6.
    """
    torch.manual_seed(seed)
    failures, chi2_total, dof_total, num_first = [], 0.0, 0, 0
    for kind, k, p, q in cases:
        vocab = p.shape[-1]
        if q is None:   # a one-hot proposer: a fixed guess per position (here the argmax of a noisy p)
            drafts = (p[:k] + 0.3 * torch.rand(k, vocab)).argmax(-1).expand(n, k).contiguous()
        else:
            drafts = torch.stack([torch.multinomial(q[i], n, replacement=True) for i in range(k)], dim=1)
        target = p.expand(n, k + 1, vocab)
        draft_probs = q.expand(n, k, vocab) if q is not None else None
        out = sampler(target, drafts, torch.full((n,), k), draft_probs, [False] * n, [None] * n)
        tokens, accepted = out.token_ids, out.num_accepted
        positions = [(0, torch.ones(n, dtype=torch.bool))] + [(1, accepted >= 1)]
        for pos, rows in positions:
            emitted = tokens[rows, pos]
            m = len(emitted)
            if m < 500:
                continue
            counts = torch.bincount(emitted, minlength=vocab)
            num_first += m if pos == 0 else 0
            if (counts[p[pos] == 0] > 0).any():
                failures.append(f"{kind} k={k} token {pos + 1}: emitted a token the target gives p = 0")
            tv = 0.5 * (counts.double() / m - p[pos].double()).abs().sum().item()
            bound = tv_bound(p[pos], m)
            if tv > bound:
                failures.append(f"{kind} k={k} V={vocab} token {pos + 1}: TV {tv:.4f} > {bound:.4f} (n={m})")
            stat, dof = pearson(counts, p[pos])
            chi2_total += stat
            dof_total += dof
    assert num_first >= min_total
    pvalue = stats.chi2.sf(chi2_total, dof_total)
    if pvalue < 1e-6:
        failures.append(f"pooled chi-square {chi2_total:.0f} on {dof_total} dof: p-value {pvalue:.2e}")
    return failures


def test_emitted_tokens_are_distributed_as_the_target():
    """12 random (p, q) pairs, V in 10..50, k in {1, 3}, 9,000 rows each: 108,000
    first tokens (plus the second token of every row that accepted draft 1)."""
    failures = check_lossless(rejection_sample, make_cases(seed=0), n=9_000, min_total=100_000)
    assert not failures, failures


def test_processed_distributions_are_the_target():
    """p and q through the engine's processed_probs (temperature / top-k / top-p /
    min-p on both): the emitted tokens follow the processed target, not its raw softmax."""
    gen = torch.Generator().manual_seed(5)
    cases = []
    for params, k in [(SamplingParams(temperature=0.6, top_k=8), 2),
                      (SamplingParams(temperature=1.4, top_p=0.8, min_p=0.05), 3),
                      (SamplingParams(temperature=0.9, top_k=15, top_p=0.9), 1)]:
        vocab = 40
        target_logits = torch.randn(k + 1, vocab, generator=gen) * 2
        draft_logits = target_logits[:k] + torch.randn(k, vocab, generator=gen) * 1.5
        st = lambda rows: SamplingTensors.build([params] * rows, vocab, torch.device("cpu"))  # noqa: E731
        p = processed_probs(target_logits, st(k + 1))
        q = processed_probs(draft_logits, st(k))
        cases.append((f"processed {params.temperature}", k, p, q))
        raw = torch.softmax(target_logits[0], dim=-1)
        assert 0.5 * (raw - p[0]).abs().sum() > 0.1        # the processing changes the target
    failures = check_lossless(rejection_sample, cases, n=10_000, seed=1)
    assert not failures, failures


# ---------------------------------------------------------------------------- the test can fail


def vectorized_sampler(bug=None):
    """A compact batched sampler (global RNG) with an optional deliberate bug, to show
    that ``check_lossless`` rejects wrong samplers and passes the right one."""
    def sample(target, drafts, num_draft, draft_probs, greedy, generators):
        n, k1, vocab = target.shape
        k = k1 - 1
        q = draft_probs if draft_probs is not None else F.one_hot(drafts, vocab).float()
        p_x = target[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_x = q.gather(-1, drafts[..., None])[..., 0]
        u = torch.rand(n, k)
        if bug == "accept_with_p":                   # ignores q
            accept = u < p_x
        elif bug == "inverted_ratio":                # min(1, q/p)
            accept = u * p_x < q_x
        else:
            accept = u * q_x < p_x
        num_acc = accept.int().cumprod(-1).sum(-1)
        rows = torch.arange(n)
        p_next = target[rows, num_acc]
        rejected = num_acc < num_draft
        if bug == "bonus_from_last_draft_position":  # bonus from p_k instead of p_{k+1}
            p_next = torch.where(rejected[:, None], p_next, target[rows, (num_acc - 1).clamp(min=0)])
        q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, num_acc] * rejected[:, None]
        residual = p_next if bug == "recover_from_p" else (p_next - q_next).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
        nxt = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1)[:, 0]
        out = torch.full((n, k1), -1, dtype=torch.long)
        out[:, :k] = torch.where(accept.int().cumprod(-1).bool(), drafts, -1)
        out.scatter_(1, num_acc[:, None], nxt[:, None])

        class Out:
            token_ids, num_accepted = out, num_acc
        return Out

    return sample


def test_check_passes_a_correct_vectorized_sampler():
    assert not check_lossless(vectorized_sampler(), make_cases(seed=2), n=5_000, seed=2)


@pytest.mark.parametrize("bug", ["recover_from_p", "accept_with_p", "inverted_ratio", "bonus_from_last_draft_position"])
def test_check_fails_a_wrong_sampler(bug):
    failures = check_lossless(vectorized_sampler(bug), make_cases(seed=2), n=5_000, seed=2)
    assert failures, f"the statistical check did not notice {bug}"
    assert any("chi-square" in f for f in failures)
    assert any("TV" in f for f in failures)


def test_verifying_q_drafts_as_one_hot_is_lossless_but_accepts_less():
    """Dropping draft_probs (verifying drafts sampled from q as fixed guesses) is not a
    distribution bug: conditioned on the guess x, one-hot speculative sampling is exact,
    so the mixture over x is too. It only lowers the acceptance rate."""
    def as_one_hot(target, drafts, num_draft, draft_probs, greedy, generators):
        return rejection_sample(target, drafts, num_draft, None, greedy, generators)

    cases = [c for c in make_cases(seed=3) if c[0] in ("independent", "close", "p_sparse")]
    assert not check_lossless(as_one_hot, cases, n=5_000, seed=3)
    kind, k, p, q = next(c for c in cases if c[0] == "close" and c[1] == 3)
    n = 5_000
    torch.manual_seed(4)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True) for i in range(k)], dim=1)
    target, num_draft = p.expand(n, k + 1, p.shape[-1]), torch.full((n,), k)
    with_q = rejection_sample(target, drafts, num_draft, q.expand(n, k, p.shape[-1]), [False] * n, [None] * n)
    without_q = rejection_sample(target, drafts, num_draft, None, [False] * n, [None] * n)
    assert with_q.num_accepted.float().mean() > without_q.num_accepted.float().mean() + 0.2
