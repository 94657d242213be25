"""The two-sample chi-square test the distribution tests share (plain sampling against
speculation): homogeneity of two lists of outcomes, outcomes seen fewer than 10 times in
both lists together pooled into one column."""
from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

import numpy as np


def chi_square_p(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """p-value that ``a`` and ``b`` were drawn from the same distribution."""
    from scipy.stats import chi2_contingency

    ca, cb = collections.Counter(a), collections.Counter(b)
    keys = sorted(k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10)
    table = np.array([[c[k] for k in keys] + [sum(c.values()) - sum(c[k] for k in keys)] for c in (ca, cb)])
    table = table[:, table.sum(axis=0) > 0]
    return float(chi2_contingency(table)[1])


def pair_p_value(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], at: int) -> float:
    """``chi_square_p`` of the pairs (token at, token at + 1) of each sample."""
    return chi_square_p([tuple(s[at : at + 2]) for s in a], [tuple(s[at : at + 2]) for s in b])
