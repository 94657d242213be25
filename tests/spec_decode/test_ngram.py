"""N-gram prompt lookup: longest match, most recent occurrence, k, min/max n; trees of continuations."""
from __future__ import annotations

import numpy as np
import pytest

from specserve.core.request import Request
from specserve.core.scheduler import ScheduledRequest
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.ngram import TREE_EXTRA_TOKENS, NgramProposer, ngram_lookup, ngram_tree

from draft_trees import branches


def test_longest_match_wins():
    # Suffix [2, 3] occurs at 1..2 (followed by 10, 11); suffix [3] alone last occurs at 6 (followed by 20).
    tokens = [5, 2, 3, 10, 11, 7, 3, 20, 2, 3]
    assert ngram_lookup(tokens, min_n=1, max_n=3, k=3) == [10, 11, 7]
    assert ngram_lookup(tokens, min_n=1, max_n=1, k=3) == [20, 2, 3]     # max_n caps the match length


def test_most_recent_occurrence():
    tokens = [1, 2, 8, 4, 1, 2, 9, 5, 1, 2]
    assert ngram_lookup(tokens, min_n=1, max_n=4, k=2) == [9, 5]
    assert ngram_lookup(tokens, min_n=2, max_n=2, k=3) == [9, 5, 1]


def test_respects_k():
    tokens = [7, 1, 2, 3, 4, 5, 6, 9, 7]
    assert ngram_lookup(tokens, 1, 3, k=1) == [1]
    assert ngram_lookup(tokens, 1, 3, k=4) == [1, 2, 3, 4]
    assert ngram_lookup(tokens, 1, 3, k=0) == []
    # Fewer tokens than k follow the match: propose what there is.
    assert ngram_lookup([4, 5, 6, 4], 1, 3, k=5) == [5, 6, 4]


def test_adaptive_proposes_as_many_tokens_as_matched():
    # Suffix [1, 2, 3] (n=3) matches at 1..3: 3 of the tokens after it, k allowing.
    tokens = [5, 1, 2, 3, 10, 11, 7, 8, 20, 1, 2, 3]
    assert ngram_lookup(tokens, 1, 4, k=8, adaptive=True) == [10, 11, 7]
    assert ngram_lookup(tokens, 1, 4, k=2, adaptive=True) == [10, 11]   # k still caps it
    assert ngram_lookup(tokens, 1, 2, k=8, adaptive=True) == [10, 11]   # so does max_n
    # Only a 1-gram repeats: a single token.
    assert ngram_lookup([3, 9, 1, 8, 3], 1, 3, k=8, adaptive=True) == [9]
    assert ngram_lookup(tokens, 1, 4, k=8, adaptive=False) == [10, 11, 7, 8, 20, 1, 2, 3]


def test_min_n():
    tokens = [3, 9, 1, 8, 3]                    # only a 1-gram repeats
    assert ngram_lookup(tokens, min_n=1, max_n=3, k=2) == [9, 1]
    assert ngram_lookup(tokens, min_n=2, max_n=3, k=2) == []


def test_max_n_bounds_longer_matches():
    # The 3-gram [1, 2, 3] matches at 0 (followed by 4); the 2-gram [2, 3] last at 6 (followed by 5).
    tokens = [1, 2, 3, 4, 0, 0, 2, 3, 5, 1, 2, 3]
    assert ngram_lookup(tokens, 1, 3, k=1) == [4]
    assert ngram_lookup(tokens, 1, 2, k=1) == [5]


@pytest.mark.parametrize("tokens", [[], [7], [1, 2, 3, 4, 5], list(range(100))])
def test_no_match(tokens):
    assert ngram_lookup(tokens, 1, 4, k=3) == []


def test_accepts_numpy_and_returns_python_ints():
    out = ngram_lookup(np.array([6, 7, 8, 6], dtype=np.int32), 1, 2, k=2)
    assert out == [7, 8] and all(type(t) is int for t in out)


def test_proposal_is_a_continuation_seen_before():
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, 5, size=rng.integers(2, 40)).tolist()
        k = int(rng.integers(1, 6))
        out = ngram_lookup(tokens, 1, 3, k)
        assert len(out) <= k
        if out:   # some earlier window equal to a suffix is followed by exactly `out`
            assert any(
                tokens[i - n : i] == tokens[-n:] and tokens[i : i + len(out)] == out
                for n in range(1, 4) for i in range(n, len(tokens))
            )


def _scheduled(tokens, lookahead, rid):
    req = Request(rid, None, tokens, SamplingParams(temperature=0.0), None, None)
    req.num_computed_tokens = len(tokens) - 1       # decoding: the last token is new
    return ScheduledRequest(req, num_new_tokens=1, num_lookahead=lookahead)


def test_proposer_respects_each_requests_num_lookahead():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]         # matches [1, 2] -> 3, 4, 5, ...
    scheduled = [_scheduled(tokens, la, str(la)) for la in (0, 1, 3, 5)]
    scheduled.append(_scheduled([9, 8, 7], 4, "nomatch"))
    proposal = NgramProposer(min_n=1, max_n=3, adaptive=False).propose(scheduled)
    assert proposal.token_ids == [[], [3], [3, 4, 5], [3, 4, 5, 6, 7], []]
    adaptive = NgramProposer(min_n=1, max_n=3).propose(scheduled)   # a 2-token match: at most 2
    assert adaptive.token_ids == [[], [3], [3, 4], [3, 4], []]
    assert proposal.probs == [None] * 5
    for s, drafts in zip(scheduled, proposal.token_ids):
        assert len(drafts) <= s.num_lookahead


# ------------------------------------------------------------------ trees
def test_tree_first_branch_is_the_adaptive_chain_and_others_are_earlier_continuations():
    # "7 8" occurs three times before the end, followed by 1 2, then 3 4, then 5 6.
    tokens = [7, 8, 5, 6, 11, 7, 8, 3, 4, 12, 7, 8, 1, 2, 13, 7, 8]
    drafts, parents = ngram_tree(tokens, 1, 4, k=6)
    assert all(-1 <= p < i for i, p in enumerate(parents))           # parents first
    chain = ngram_lookup(tokens, 1, 4, 6, adaptive=True)
    assert chain == [1, 2]
    paths = branches(drafts, parents)
    assert paths[0] == chain
    # The 2-token suffix "7 8": earlier occurrences, most recent first, 2 tokens each, until
    # the tree holds min(k, 2 + TREE_EXTRA_TOKENS) tokens.
    assert paths == [[1, 2], [3, 4]] and len(drafts) == 2 + TREE_EXTRA_TOKENS


def test_tree_size_is_bounded_by_k_and_by_the_match():
    tokens = [7, 8, 5, 6, 11, 7, 8, 3, 4, 12, 7, 8, 1, 2, 13, 7, 8]
    for k in range(1, 8):
        drafts, parents = ngram_tree(tokens, 1, 4, k)
        assert len(drafts) == len(parents) == min(k, 2 + TREE_EXTRA_TOKENS)   # longest match: 2 tokens
        # Shared prefixes are merged: no two siblings carry the same token.
        siblings = list(zip(parents, drafts))
        assert len(set(siblings)) == len(siblings)


def test_tree_merges_shared_prefixes_and_adds_shorter_matches():
    # "1 2" is followed by 3 4 and by 3 9: one node 3 with two children. The 1-token suffix
    # "2" also occurs before 5, a third branch from a shorter match.
    tokens = [2, 5, 20, 1, 2, 3, 9, 21, 1, 2, 3, 4, 22, 1, 2]
    drafts, parents = ngram_tree(tokens, 1, 4, k=8)
    paths = branches(drafts, parents)
    assert paths[0] == [3, 4]
    assert [3, 9] in paths and [5] in paths
    assert drafts.count(3) == 1


def test_tree_no_match():
    assert ngram_tree([1, 2, 3, 4], 1, 4, 5) == ([], [])
    assert ngram_tree([1, 2, 3, 1], 2, 4, 5) == ([], [])


def test_tree_proposer_returns_parents():
    tokens = [7, 8, 5, 6, 11, 7, 8, 3, 4, 12, 7, 8, 1, 2, 13, 7, 8]
    scheduled = [_scheduled(tokens, 3, "a"), _scheduled([9, 8, 7], 4, "none")]
    proposal = NgramProposer(min_n=1, max_n=4, tree=True).propose(scheduled)
    assert proposal.token_ids == [[1, 2, 3], []]
    assert proposal.parents == [[-1, 0, -1], []]
    assert proposal.probs == [None, None]


def test_tree_is_an_ngram_option_only():
    from specserve.config import SpeculativeConfig

    assert SpeculativeConfig(method="ngram", prompt_lookup_tree=True).prompt_lookup_tree
    for method in ("draft_model", "eagle"):
        with pytest.raises(ValueError, match="prompt_lookup_tree is an ngram option"):
            SpeculativeConfig(method=method, model="/some/draft", prompt_lookup_tree=True)
