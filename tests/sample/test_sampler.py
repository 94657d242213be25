"""processed_probs against a plain per-row reference, and sample_from_probs:
seeded reproducibility, independence from batch neighbours, and that it really
samples from p (chi-square and total-variation checks); keyed_generator: one
stream per (seed, output index, purpose), independent of one another."""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from specserve.sample.sampler import (CHOICE, REJECTION, SamplingTensors, choose_tokens, keyed_generator,
                                      processed_probs, sample_from_probs, top_k_top_p)
from specserve.sampling_params import SamplingParams

V = 40


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, float64, loops: temperature, then top-k, then top-p, then min-p."""
    x = logits.double() / (p.temperature if p.temperature > 0 else 1.0)
    vocab = x.numel()
    keep = [True] * vocab
    if 0 < p.top_k < vocab:
        kth = sorted(x.tolist(), reverse=True)[p.top_k - 1]
        keep = [x[i].item() >= kth for i in range(vocab)]

    def renorm() -> torch.Tensor:
        w = torch.tensor([math.exp(x[i].item() - x.max().item()) if keep[i] else 0.0 for i in range(vocab)],
                         dtype=torch.float64)
        return w / w.sum()

    probs = renorm()
    if p.top_p < 1.0:
        mass = 0.0
        for i in sorted(range(vocab), key=lambda i: -probs[i].item()):
            if mass >= p.top_p:          # the tokens above already cover top_p: drop the rest
                keep[i] = False
            mass += probs[i].item()
        probs = renorm()
    if p.min_p > 0.0:
        threshold = p.min_p * probs.max().item()
        probs = torch.where(probs < threshold, 0.0, probs)
        probs = probs / probs.sum()
    return probs


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    # (torch.testing.assert_close would import torch.distributed on first use: seconds.)
    err = (got.double() - want.double()).abs()
    assert (err <= atol + rtol * want.double().abs()).all(), f"max error {err.max().item():.2e}"


def run_processed(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    st = SamplingTensors.build(params, logits.shape[-1], logits.device)
    return processed_probs(logits, st)


PARAMS = [
    SamplingParams(),                                        # nothing: plain softmax
    SamplingParams(temperature=0.0),                         # greedy rows: processed at temperature 1
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(top_k=1),
    SamplingParams(top_k=5),
    SamplingParams(top_k=V),                                  # top_k == vocab: disabled
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.3),
    SamplingParams(top_p=1e-6),                               # keeps exactly the top token
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.9),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=8, min_p=0.3),
    SamplingParams(temperature=0.8, top_p=0.6, min_p=0.2),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_processed_probs_matches_reference(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=gen) * 3
    got = run_processed(logits, [params] * 8)
    for i in range(8):
        want = reference_probs(logits[i], params)
        assert torch.equal(got[i] > 0, want > 0), f"row {i}: kept tokens differ"
        assert_close(got[i], want, atol=1e-5, rtol=1e-4)
        assert got[i].sum().item() == pytest.approx(1.0, abs=1e-5)


def test_order_is_temperature_top_k_top_p_min_p():
    # With one row where the order changes the answer: top-p after top-k renormalizes
    # over the top-k tokens, so applying it first (or to the raw softmax) keeps a different set.
    logits = torch.log(torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]]))
    got = run_processed(logits, [SamplingParams(top_k=2, top_p=0.5)])[0]
    # top-2 renormalized = [0.545, 0.455]; 0.545 >= 0.5 so only the first survives.
    assert got.tolist() == pytest.approx([1.0, 0, 0, 0, 0])
    # Temperature before top-p: at T=0.5 the top token alone has 0.4 >= 0.35; at T=1 only 0.3.
    got = run_processed(logits, [SamplingParams(temperature=0.5, top_p=0.35)])[0]
    assert (got > 0).tolist() == [True, False, False, False, False]
    got = run_processed(logits, [SamplingParams(top_p=0.35)])[0]
    assert (got > 0).tolist() == [True, True, False, False, False]


def test_top_p_keeps_at_least_one_token():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, V, generator=gen) * 5
    logits[0] = 0.0                   # uniform row: ties, still exactly one kept
    logits[1, 3] = 100.0              # one token holds all the mass
    got = run_processed(logits, [SamplingParams(top_p=1e-9)] * 16)
    assert ((got > 0).sum(dim=-1) == 1).all()
    assert torch.equal(got.argmax(dim=-1)[1:], logits.argmax(dim=-1)[1:])
    assert torch.allclose(got.sum(dim=-1), torch.ones(16))


def test_rows_with_different_params_each_get_their_own():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(len(PARAMS), V, generator=gen) * 2
    batched = run_processed(logits, PARAMS)
    for i, p in enumerate(PARAMS):
        alone = run_processed(logits[i : i + 1], [p])[0]
        assert_close(batched[i], alone, atol=1e-6, rtol=1e-5)
        assert_close(batched[i], reference_probs(logits[i], p), atol=1e-5, rtol=1e-4)
    # Same logits in every row, different params: the rows really differ.
    same = run_processed(logits[:1].expand(len(PARAMS), V).contiguous(), PARAMS)
    assert len({tuple((row > 0).tolist()) for row in same}) > 5


def _ranked_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows from nearly flat (a nucleus of most of the vocabulary) to peaked (a few tokens), some
    with tokens banned (-inf, as logit bias and grammars leave them)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1.3, rows)[:, None]                       # 0.1 .. 20
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[::3, : vocab // 2] = float("-inf")
    return logits


MIXED = [SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(top_k=12, top_p=0.7),
         SamplingParams(top_p=0.3, min_p=0.1), SamplingParams(top_k=3)]


@pytest.mark.parametrize("head", [1, 8, 30])
def test_ranking_a_head_gives_what_ranking_the_whole_row_gives(head):
    """Rows of every kind in one batch: the head's answer (falling back to the full ranking where a
    nucleus reaches past it) is the full sort's, kept tokens exactly, probabilities to rounding."""
    logits = _ranked_logits(24, V, seed=head)
    params = [MIXED[i % len(MIXED)] for i in range(24)]
    st = SamplingTensors.build(params, V, logits.device)
    got, want = top_k_top_p(logits, st, head=head), top_k_top_p(logits, st, head=V)
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    finite = want > float("-inf")
    assert torch.equal(got[finite], want[finite])          # kept tokens keep their logits
    for i, p in enumerate(params):
        assert_close(processed_probs(logits[i:i + 1], SamplingTensors.build([p], V, logits.device))[0],
                     reference_probs(logits[i], p), atol=1e-5, rtol=1e-4)


def test_a_nucleus_inside_the_head_sorts_nothing(monkeypatch):
    """Peaked rows of a large vocabulary with top-k or top-p: torch.topk ranks their heads, no row is
    sorted in full (a row with neither, however flat, asks for no ranks); one nearly flat top-p row
    makes the whole batch sorted, with the same answer."""
    vocab = 4 * 1024
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **kw: sorts.append(self.shape) or real_sort(self, *a, **kw))
    peaked = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5)) * 8
    peaked[2, ::2] = float("-inf")
    peaked[3] *= 0.001                                                   # flat, and neither top-k nor top-p
    params = [SamplingParams(top_p=0.95), SamplingParams(top_k=40), SamplingParams(top_k=50, top_p=0.9),
              SamplingParams()]
    st = SamplingTensors.build(params, vocab, peaked.device)
    fast = top_k_top_p(peaked, st)
    assert sorts == []
    assert torch.equal(fast == float("-inf"), top_k_top_p(peaked, st, head=vocab) == float("-inf"))
    assert (fast[3] == peaked[3]).all()                                  # no top-k, no top-p: untouched
    flat = torch.cat([peaked, torch.randn(1, vocab) * 0.01])
    st = SamplingTensors.build(params + [SamplingParams(top_p=0.9)], vocab, flat.device)
    sorts.clear()
    both = top_k_top_p(flat, st)
    assert sorts == [(5, vocab)]
    assert torch.equal(both[:4] == float("-inf"), fast == float("-inf"))
    assert 0.85 * vocab < (both[4] > float("-inf")).sum() < 0.95 * vocab


# ---------------------------------------------------------------------------- sampling


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_sample_from_probs_is_reproducible_with_seeds():
    probs = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(3)), dim=-1)
    gens_a, gens_b = _gens([1, 2, 3, 4]), _gens([1, 2, 3, 4])
    a = [sample_from_probs(probs, gens_a) for _ in range(30)]
    b = [sample_from_probs(probs, gens_b) for _ in range(30)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len({tuple(x.tolist()) for x in a}) > 1                  # it does move on
    c = [sample_from_probs(probs, _gens([5, 6, 7, 8])) for _ in range(3)]
    assert any(not torch.equal(x, y) for x, y in zip(a, c))


def test_sample_from_probs_row_independent_of_batch_neighbours():
    probs = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(4)), dim=-1)
    alone_gen, batch_gens = _gens([42]), _gens([7, 42, 9])
    alone = [sample_from_probs(probs[1:2], alone_gen).item() for _ in range(50)]
    in_batch = [sample_from_probs(probs, batch_gens)[1].item() for _ in range(50)]
    assert alone == in_batch
    # Different neighbours (and global-RNG rows) do not disturb it either.
    torch.manual_seed(0)
    mixed_gens = [None, _gens([42])[0], None]
    in_mixed = [sample_from_probs(probs[[2, 1, 0]], mixed_gens)[1].item() for _ in range(50)]
    assert in_mixed == alone


def test_sample_from_probs_never_picks_a_zero_probability_token():
    probs = run_processed(torch.randn(2000, V, generator=torch.Generator().manual_seed(5)), [SamplingParams(top_k=3)] * 2000)
    torch.manual_seed(5)
    tokens = sample_from_probs(probs, [None] * 2000)
    assert (probs.gather(1, tokens[:, None]) > 0).all()


def test_sample_from_probs_samples_from_p():
    """N = 50,000 draws from one p over V = 40 tokens (10 of them zero).

    Chi-square over the non-zero cells must not reject at the 1e-6 level, and the
    total-variation distance must be below E[TV] + t, where
    E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N)  (Jensen) and, by McDiarmid (one draw
    moves TV by at most 1/N), P(TV > E[TV] + t) <= exp(-2 N t^2) = 1e-6 for
    t = sqrt(ln(1e6) / (2N)). Here that bound is about 0.02.
    """
    n = 50_000
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(V, generator=gen) * 1.5
    logits[:10] = float("-inf")
    p = torch.softmax(logits, dim=-1)
    torch.manual_seed(6)
    tokens = sample_from_probs(p.expand(n, V), [None] * n)
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[:10].sum() == 0
    nz = p > 0
    expected = p[nz].double() / p[nz].double().sum() * n
    chi2 = stats.chisquare(counts[nz].numpy(), expected.numpy())
    assert chi2.pvalue > 1e-6, chi2
    tv = 0.5 * (counts / n - p.double()).abs().sum().item()
    bound = 0.5 * (p.double() * (1 - p.double()) / n).sqrt().sum().item() + math.sqrt(math.log(1e6) / (2 * n))
    assert bound < 0.025
    assert tv < bound, (tv, bound)
    # The same check rejects a nearby wrong distribution (power check of the bound).
    wrong = torch.softmax(logits * 1.2, dim=-1)
    assert 0.5 * (counts / n - wrong.double()).abs().sum().item() > bound


def test_choose_tokens_takes_the_argmax_for_greedy_rows_and_samples_the_rest():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(6))
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=5)
    params = [greedy, hot, greedy, hot]
    a = choose_tokens(logits, params, [None, _gens([1])[0], None, _gens([2])[0]])
    assert a.tokens[0] == logits[0].argmax().item() and a.tokens[2] == logits[2].argmax().item()
    assert torch.equal(a.probs, run_processed(logits, params))
    # a sampled row draws from its own generator, as sample_from_probs does alone
    assert a.tokens[3] == sample_from_probs(a.probs[3:4], _gens([2])).item()
    assert all(a.probs[i, t] > 0 for i, t in enumerate(a.tokens))
    assert choose_tokens(logits, [greedy] * 4, [None] * 4).probs is None


def test_a_row_without_top_p_keeps_its_whole_distribution_beside_a_row_with_it():
    """Sorting for another row's top-p must not drop this row's tail where float32 sums reach 1."""
    logits = torch.cat([torch.full((1, V), -30.0), torch.randn(1, V)])
    logits[0, 0] = 30.0                               # row 0: one token holds nearly all the mass
    plain = SamplingParams(temperature=1.0)
    alone = run_processed(logits[:1], [plain])
    beside = run_processed(logits, [plain, SamplingParams(temperature=1.0, top_p=0.5)])[:1]
    assert torch.equal(alone, beside) and (alone > 0).all()


# ---------------------------------------------------------------------------- keyed generators


def _uniforms(gen: torch.Generator, n: int = 8) -> list[float]:
    return torch.empty(n).uniform_(generator=gen).tolist()


def test_a_keyed_generator_depends_on_its_key_alone():
    """The numbers for (seed, index, purpose) are the same however often and in whatever order
    they are asked for, and differ when any part of the key does."""
    a = _uniforms(keyed_generator(7, 3, CHOICE, "cpu"))
    _uniforms(keyed_generator(7, 4, CHOICE, "cpu"))
    assert _uniforms(keyed_generator(7, 3, CHOICE, "cpu")) == a
    others = [keyed_generator(7, 4, CHOICE, "cpu"), keyed_generator(7, 3, REJECTION, "cpu"),
              keyed_generator(8, 3, CHOICE, "cpu"),
              keyed_generator(7 + 2**32, 3, CHOICE, "cpu")]   # the CPU generator reads 32 bits of its seed
    assert all(_uniforms(g) != a for g in others)
    assert keyed_generator(None, 3, CHOICE, "cpu") is None     # greedy


def test_no_two_keys_of_one_request_share_a_stream():
    """Every (index, purpose) of one request seeds a different stream, also in the 32 bits the
    CPU generator keeps, and sample i + 1 of a request (seed + 1) does not repeat sample i's
    streams one index later."""
    firsts = {(s, i, p): tuple(_uniforms(keyed_generator(s, i, p, "cpu"), 4))
              for s in (41, 42) for i in range(2000) for p in (CHOICE, REJECTION)}
    assert len(set(firsts.values())) == len(firsts)


def test_keyed_draws_over_output_indices_sample_from_p():
    """One request's choices at 20,000 output indices of the same p are independent draws
    from p (chi-square), and consecutive ones are not correlated."""
    n = 20_000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(8)) * 1.5
    p = torch.softmax(logits, dim=-1)
    tokens = sample_from_probs(p.expand(n, V), [keyed_generator(123, j, CHOICE, "cpu") for j in range(n)])
    counts = torch.bincount(tokens, minlength=V).double()
    assert stats.chisquare(counts.numpy(), (p.double() * n).numpy()).pvalue > 1e-6
    # Pairs of consecutive indices are distributed as p x p: each of the 25 pairs of the five
    # likeliest tokens is counted about as often as p x p says (a multinomial cell count is
    # about Poisson, so the sum of (observed - expected)^2 / expected is about chi-square, 25 df).
    pairs = torch.bincount(tokens[:-1] * V + tokens[1:], minlength=V * V).double().view(V, V)
    top = p.topk(5).indices
    observed = pairs[top][:, top]
    expected = (p[top, None] * p[None, top]).double() * (n - 1)
    assert expected.min() > 50
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    assert stats.chi2.sf(statistic, df=25) > 1e-6


@pytest.mark.parametrize("chunk_elements", [1 << 23, 100], ids=["one-chunk", "a-row-a-chunk"])
def test_exponential_noise_is_what_exponential_draws_from_the_same_generators(monkeypatch, chunk_elements):
    """The noise rows are the numbers ``Tensor.exponential_`` draws (bitwise, on a CPU): keyed
    generators, the global RNG (None), and rows split over chunks, so seeded samples are the
    same as before the faster draw."""
    import specserve.sample.sampler as sampler

    monkeypatch.setattr(sampler, "NOISE_CHUNK_ELEMENTS", chunk_elements)
    vocab = 49152
    keys = [(7, 0), (7, 1), (123456789, 40), None, (0, 3)]

    def generators():
        return [None if k is None else keyed_generator(k[0], k[1], CHOICE, "cpu") for k in keys]

    torch.manual_seed(11)
    got = sampler.exponential_noise(len(keys), vocab, generators(), "cpu")                  # [5, V]
    torch.manual_seed(11)
    want = torch.empty(len(keys), vocab)
    for row, gen in zip(want, generators()):
        row.exponential_(generator=gen)
    assert torch.equal(got, want.clamp_(min=torch.finfo(torch.float32).tiny))


def test_row_argmax_is_argmax_with_ties_infinities_and_nan():
    from specserve.sample.sampler import row_argmax

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        x = torch.randint(-3, 3, (4, 1 + trial * 37), generator=gen).float()   # many ties
        if trial % 3 == 0:
            x[x < 0] = float("-inf")
        if trial % 7 == 0:
            x[1, trial % x.shape[1]] = float("nan")
        assert torch.equal(row_argmax(x), x.argmax(dim=-1)), trial
        assert torch.equal(row_argmax(x[0]), x[0].argmax())
