"""DraftTreeGrower alone, with a made-up draft: EAGLE-2's selection (the max_nodes best of the
candidates, top_k expanded per depth, parents first), the forwards it asks for, and that a tree of
sampled children has a shape that does not depend on the values drawn (what keeps recursive
rejection sampling exact)."""
from __future__ import annotations

import torch

from specserve.config import TreeConfig
from specserve.core.request import Request
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.draft_tree import DraftTreeGrower

VOCAB = 40


def _request(params: SamplingParams, seed=None) -> Request:
    r = Request("r", None, [1, 2, 3], params, seed, None)
    r.num_computed_tokens = 3
    return r


def _logits_after(token: int) -> torch.Tensor:
    """The made-up draft's next-token logits after ``token`` (the same for every context)."""
    g = torch.Generator().manual_seed(1000 + token)
    return torch.randn(VOCAB, generator=g) * 2.0


def _grow(tree: TreeConfig, params: SamplingParams, root_token=7, constant=False):
    grower = DraftTreeGrower(tree, tree.max_depth or 4, VOCAB)
    req = _request(params)
    steps = []

    def forward(batch):
        steps.extend(batch)
        rows = [_logits_after(0 if constant else t) for st in batch for t in st.token_ids]
        return torch.stack(rows)

    proposal = grower.grow([req], [64], _logits_after(0 if constant else root_token)[None], forward)
    return proposal, steps


def _candidates(tree: TreeConfig, root_token=7):
    """Brute force: every candidate EAGLE-2 generates (top_k children of the root and of the top_k
    best of each depth), as (score, creation index, path)."""
    def children(path, score):
        logp = torch.log_softmax(_logits_after(path[-1] if path else root_token), -1)
        top = logp.topk(tree.top_k)
        return [(score + v, path + [t]) for v, t in zip(top.values.tolist(), top.indices.tolist())]
    layer = children([], 0.0)
    everything = list(layer)
    for _ in range(1, tree.max_depth):
        expand = sorted(layer, key=lambda c: -c[0])[: tree.top_k]
        layer = [c for score, path in sorted(expand, key=lambda c: everything.index(c)) for c in children(path, score)]
        everything += layer
    return everything


def test_greedy_trees_are_the_best_candidates_parents_first():
    tree = TreeConfig(top_k=3, max_nodes=10, max_depth=4)
    proposal, steps = _grow(tree, SamplingParams(temperature=0))
    tokens, parents = proposal.token_ids[0], proposal.parents[0]
    assert len(tokens) == 10 and all(p < i for i, p in enumerate(parents))
    paths = []
    for t, p in zip(tokens, parents):
        paths.append((paths[p] if p >= 0 else []) + [t])
    best = sorted(_candidates(tree), key=lambda c: -c[0])[:10]
    assert sorted(map(tuple, paths)) == sorted(tuple(path) for _, path in best)
    # one forward per depth after the root, at most top_k nodes each, parents over the tree's slots
    assert len(steps) == 3 and all(len(st.token_ids) <= 3 for st in steps)
    assert [st.tree_cached for st in steps] == [1, 4, 7]
    assert all(len(st.span_parents) == st.tree_cached + len(st.token_ids) for st in steps)


def test_sampled_trees_have_a_shape_independent_of_the_values_drawn():
    """With a draft whose distribution is the same everywhere, two draws give different tokens but
    the same tree shape: a child is kept by its rank, never by the token drawn for it."""
    tree = TreeConfig(top_k=3, max_nodes=12, max_depth=4, children="sampled")
    params = SamplingParams(temperature=1.0)
    shapes, token_sets = set(), set()
    for seed in range(4):
        torch.manual_seed(seed)
        proposal, _ = _grow(tree, params, constant=True)
        shapes.add(tuple(proposal.parents[0]))
        token_sets.add(tuple(proposal.token_ids[0]))
        q = proposal.probs[0]                                                  # [n, V] each node's parent's q
        assert q.shape == (12, VOCAB) and torch.allclose(q.sum(-1), torch.ones(12))
        siblings = {}
        for i, p in enumerate(proposal.parents[0]):
            siblings.setdefault(p, []).append(proposal.token_ids[0][i])
        assert all(len(set(s)) == len(s) for s in siblings.values())           # without replacement
    assert len(shapes) == 1 and len(token_sets) > 1


def test_a_one_deep_tree_is_the_roots_top_k():
    """max_depth 1: the root's top_k tokens, best first, and no draft forward."""
    tree = TreeConfig(top_k=2, max_nodes=2, max_depth=1)
    proposal, steps = _grow(tree, SamplingParams(temperature=0))
    q = torch.softmax(_logits_after(7), -1)
    assert proposal.token_ids[0] == q.topk(2).indices.tolist() and proposal.parents[0] == [-1, -1]
    assert steps == []                                  # one depth: no draft forward past the root's


def _depths(proposal) -> list[int]:
    depths = []
    for p in proposal.parents[0]:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def test_a_tree_reaches_its_depth_when_it_expands_more_nodes_than_it_keeps():
    """Tree 2/6, 5 deep: the draft expands 2 nodes at each of depths 1-4 (8, more than the 6 the
    tree keeps), each in a lookahead slot of its own (SpeculativeConfig.num_lookahead_slots
    reserves 8), so the best path, a chain here, is 5 deep; with only 6 slots the draft could
    expand 6 nodes and the tree would stop at depth 4."""
    from specserve.config import SpeculativeConfig

    tree = TreeConfig(top_k=2, max_nodes=6, max_depth=5)
    spec = SpeculativeConfig(method="draft_model", model="unused", num_speculative_tokens=5, tree=tree)
    assert spec.num_lookahead_slots == 8
    logits = torch.full((VOCAB,), -20.0)
    logits[0], logits[1] = 2.2, 0.0        # everywhere: token 0 at about 0.9, token 1 at 0.1
    steps = []

    def forward(batch):
        steps.extend(batch)
        return logits.expand(sum(len(st.token_ids) for st in batch), VOCAB)

    for slots, deepest, forwards in ((8, 5, 4), (6, 4, 3)):
        steps.clear()
        proposal = DraftTreeGrower(tree, 5, VOCAB).grow([_request(SamplingParams(temperature=0))], [slots],
                                                        logits[None], forward)
        assert len(proposal.token_ids[0]) == 6 and max(_depths(proposal)) == deepest
        assert len(steps) == forwards and sum(len(st.token_ids) for st in steps) <= slots
        assert max(st.tree_cached + len(st.token_ids) for st in steps) <= slots + 1   # root + its slots


def test_lookahead_slots_cover_a_trees_expansions():
    from specserve.config import SpeculativeConfig

    def slots(k, **tree):
        return SpeculativeConfig(method="draft_model", model="unused", num_speculative_tokens=k,
                                 tree=tree).num_lookahead_slots

    assert slots(5, top_k=4, max_nodes=16) == 16          # 4 x 4 expansions: the nodes are more
    assert slots(5, top_k=4, max_nodes=12) == 16          # 4 x 4 expansions past 12 nodes
    assert slots(4, top_k=2, max_nodes=6, max_depth=6) == 10
    assert SpeculativeConfig(method="draft_model", model="unused", num_speculative_tokens=5).num_lookahead_slots == 5
