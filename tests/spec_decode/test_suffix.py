"""Suffix decoding: the counting suffix trie, its draft trees (longest match,
frequency order, valid parents, min probability, depth cap), the global cache across
requests (LRU bound, a continuation learnt from an earlier request), the config, and
end to end on the tiny random model: greedy speculative == plain token for token
(batch 1 and several), and sampled pairs distributed as plain sampling."""
from __future__ import annotations

import collections
import random

import pytest

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.spec_decode.suffix import (GlobalSuffixCache, SuffixProposer, SuffixTrie,
                                          grow_tree, is_chain)

from chi_square import pair_p_value
from draft_trees import branches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FakeRequest:
    """What the proposer reads of a Request (weak-referenceable, like one)."""

    def __init__(self, prompt, output=(), request_id="r"):
        self.all_token_ids = list(prompt) + list(output)
        self.num_prompt_tokens = len(prompt)
        self.request_id = request_id

    def append(self, *tokens):
        self.all_token_ids.extend(tokens)


def valid_tree(drafts, parents):
    assert len(drafts) == len(parents)
    assert all(-1 <= p < i for i, p in enumerate(parents))            # parents before children
    siblings = list(zip(parents, drafts))
    assert len(set(siblings)) == len(siblings)                         # no repeated sibling token


# ------------------------------------------------------------------ the trie
def brute_counts(seqs, depth):
    counts = collections.Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for n in range(1, depth + 1):
                if i + n <= len(seq):
                    counts[tuple(seq[i:i + n])] += 1
    return counts


def trie_counts(trie):
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        if path:
            out[path] = trie.count[node]
            assert trie.find(path) == node
        kids = list(trie.children(node))
        assert trie.total[node] == sum(trie.count[c] for _, c in kids)
        stack.extend((path + (t,), c) for t, c in kids)
    assert len(trie.edges) == len(out)
    return out


def test_trie_counts_every_substring_up_to_its_depth_incrementally():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    trie = SuffixTrie(depth=5)
    for seq in seqs:
        cursor, i = trie.new_cursor(), 0
        while i < len(seq):   # in pieces of random sizes, as tokens arrive
            step = rng.randrange(1, 5)
            cursor = trie.extend(cursor, seq[i:i + step])
            i += step
    assert trie_counts(trie) == brute_counts(seqs, 5)
    assert trie.num_nodes == len(brute_counts(seqs, 5))
    trie.remove(seqs[1])
    trie.remove(seqs[3])
    assert trie_counts(trie) == brute_counts([seqs[0], seqs[2], seqs[4]], 5)
    assert trie.num_nodes == len(brute_counts([seqs[0], seqs[2], seqs[4]], 5))
    trie.extend([], seqs[3])      # freed nodes are reused
    assert trie_counts(trie) == brute_counts([seqs[0], seqs[2], seqs[3], seqs[4]], 5)
    for seq in (seqs[0], seqs[2], seqs[3], seqs[4]):
        trie.remove(seq)
    assert trie.total[trie.root] == 0 and trie.num_nodes == 0 and not trie.edges


def test_longest_match_wins_and_needs_a_continuation():
    trie = SuffixTrie(depth=8)
    # "5 1 2" was followed by 9; "1 2" alone by 3 (twice).
    seq = [1, 2, 3, 7, 1, 2, 3, 5, 1, 2, 9, 6, 5, 1, 2]
    cursor = trie.extend([], seq)
    n, node = trie.longest_match(seq[-6:], cursor)
    assert n == 3
    assert grow_tree(trie, node, 1, 4, 0.0)[0] == [9]
    assert trie.longest_match(seq[-6:]) == (n, node)        # the same walking from the root
    assert trie.longest_match([8, 8]) == (0, None)          # never seen
    n, node = trie.longest_match([6, 5, 1, 2, 9, 6], None)  # the 6 tokens never occurred, the last 5 did
    assert n == 5 and grow_tree(trie, node, 1, 4, 0.0)[0] == [5]


def after_1_2(depth: int):
    """A trie of a sequence where "1 2" is followed by 3 4 three times, 3 8 once, 5 6 twice
    (and ends with "1 2"): (trie, the node of that last "1 2")."""
    trie = SuffixTrie(depth=depth)
    seq = [1, 2, 3, 4, 0, 1, 2, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2, 3, 8, 0, 1, 2, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2]
    cursor = trie.extend([], seq)
    _, node = trie.longest_match(seq[-2:], cursor)
    return trie, node


def test_tree_is_most_frequent_first_with_valid_parents():
    trie, node = after_1_2(depth=8)
    drafts, parents, score = grow_tree(trie, node, k=8, max_depth=2, min_token_prob=0.0)
    valid_tree(drafts, parents)
    assert branches(drafts, parents) == [[3, 4], [3, 8], [5, 6]]      # most probable first
    assert drafts[:2] == [3, 4] and parents[:2] == [-1, 0]            # the best path is drafts 0, 1
    assert score == pytest.approx(4 / 6 + 3 / 6 + 1 / 6 + 2 / 6 + 2 / 6)
    # k tokens at most, taken best first: 3 (4/6), 4 (3/6), then 5 or 6 (2/6) ...
    drafts, parents, _ = grow_tree(trie, node, k=3, max_depth=2, min_token_prob=0.0)
    valid_tree(drafts, parents)
    assert drafts[:2] == [3, 4] and len(drafts) == 3 and drafts[2] == 5


def test_min_token_prob_and_depth_cap():
    trie, node = after_1_2(depth=12)
    drafts, parents, _ = grow_tree(trie, node, k=8, max_depth=2, min_token_prob=0.4)
    assert branches(drafts, parents) == [[3, 4]]                       # 4/6 then 3/6; 5 (2/6) is out
    drafts, parents, _ = grow_tree(trie, node, k=8, max_depth=1, min_token_prob=0.0)
    assert sorted(drafts) == [3, 5] and parents == [-1, -1]
    for depth in (1, 2, 3, 5):
        drafts, parents, _ = grow_tree(trie, node, k=16, max_depth=depth, min_token_prob=0.0)
        valid_tree(drafts, parents)
        assert max(len(b) for b in branches(drafts, parents)) <= depth
    assert grow_tree(trie, node, k=8, max_depth=4, min_token_prob=1.0)[0] == []


def test_a_single_path_is_a_chain():
    p = SuffixProposer(max_depth=4, min_token_prob=0.1, max_cached_requests=0, max_spec_factor=2.0)
    req = FakeRequest([10, 11, 12, 13, 14, 15, 10, 11])
    drafts, parents = p.propose_one(req, 4)
    assert drafts == [12, 13, 14, 15] and parents is None
    assert is_chain([-1, 0, 1]) and not is_chain([-1, -1])


def test_max_spec_factor_limits_drafts_by_the_match_length():
    req = FakeRequest([5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 1])            # the match "5 1": 2 tokens
    assert SuffixProposer(max_depth=8, max_cached_requests=0).propose_one(req, 8)[0] == [2, 3]
    assert SuffixProposer(max_depth=8, max_cached_requests=0, max_spec_factor=2.0).propose_one(req, 8)[0] == [2, 3, 4, 5]
    assert SuffixProposer(max_depth=8, max_cached_requests=0, max_spec_factor=0.1).propose_one(req, 8)[0] == [2]


def test_proposer_is_incremental_and_respects_k():
    p = SuffixProposer(max_depth=6, min_token_prob=0.0, max_cached_requests=0, max_spec_factor=8.0)
    req = FakeRequest([1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert p.propose_one(req, 3) == ([3, 4, 5], None)
    req.append(3, 4)
    assert p.propose_one(req, 8) == ([5, 6, 7, 1, 2, 3], None)      # the depth cap: 6
    assert p.local[req].num_seen == 11
    assert p.propose_one(req, 0) == ([], None)
    assert p.propose_one(FakeRequest([1, 2, 3]), 4) == ([], None)   # nothing seen before


# ------------------------------------------------------------------ global cache
def test_a_finished_requests_output_is_proposed_for_a_later_one():
    p = SuffixProposer(max_depth=8, min_token_prob=0.1, max_cached_requests=4, max_spec_factor=4.0)
    instruction = [900, 901, 902]
    first = FakeRequest([1, 2, 3] + instruction)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    for t in answer:          # decoded token by token, the proposer seeing each step
        p.propose_one(first, 4)
        first.append(t)
    p.propose_one(first, 4)
    del first                 # finished and gone: its trie goes, its output stays in the global one
    second = FakeRequest([7, 8, 9] + instruction, [40])
    drafts, parents = p.propose_one(second, 6)
    assert drafts == [41, 42, 43, 44, 45, 46] and parents is None
    # The start of an answer too: the prompt's last tokens prime the global trie.
    third = FakeRequest([5, 5, 5] + instruction)
    assert p.propose_one(third, 3)[0] == [40, 41, 42]
    assert p.propose_one(FakeRequest([5, 5, 5, 903]), 3)[0] == []


def test_the_global_cache_is_bounded_least_recently_used_out():
    cache = GlobalSuffixCache(depth=6, max_requests=3, max_tokens=1000)
    keys, cursors = [], {}
    for i in range(3):
        key = cache.add_sequence()
        keys.append(key)
        cursors[key] = cache.extend(key, [], [100 + i, 200 + i, 300 + i])
    cursors[keys[0]] = cache.extend(keys[0], cursors[keys[0]], [400])   # sequence 0 used again
    fourth = cache.add_sequence()
    cache.extend(fourth, [], [500, 501])
    assert list(cache.sequences) == [keys[2], keys[0], fourth]          # sequence 1 (LRU) is out
    assert cache.trie.find([101]) is None and cache.trie.find([100, 200, 300, 400]) is not None
    assert cache.extend(keys[1], [], [7]) is None                        # an evicted one is not extended
    # A token budget too: 3 + 4 + 2 = 9 tokens; a budget of 6 drops the least recently used.
    cache.max_tokens = 6
    cache._evict(keep=fourth)
    assert list(cache.sequences) == [keys[0], fourth] and cache.num_tokens == 6
    assert cache.num_tokens == sum(len(s) for s in cache.sequences.values())
    assert cache.trie.num_nodes == len(brute_counts(cache.sequences.values(), 6))


def test_proposer_keeps_at_most_max_cached_requests():
    p = SuffixProposer(max_depth=4, min_token_prob=0.1, max_cached_requests=2)
    reqs = [FakeRequest([1, 2, 3], [10 * i + 1]) for i in range(5)]
    for r in reqs:
        p.propose_one(r, 2)
    assert len(p.global_cache.sequences) == 2
    assert p.global_cache.trie.find([41]) is not None and p.global_cache.trie.find([11]) is None


# ------------------------------------------------------------------ config
def test_config_validates_the_suffix_options():
    spec = SpeculativeConfig(method="suffix", suffix_max_depth=5, suffix_min_token_prob=0.2,
                             suffix_max_cached_requests=0)
    assert spec.method == "suffix"
    for bad in ({"suffix_max_depth": 0}, {"suffix_max_depth": 32}, {"suffix_min_token_prob": 1.5},
                {"suffix_min_token_prob": True}, {"suffix_max_cached_requests": -1}, {"suffix_max_spec_factor": 0}, {"model": "/a/draft"}):
        with pytest.raises(ValueError):
            SpeculativeConfig(method="suffix", **bad)
    with pytest.raises(ValueError, match="suffix options, not for method 'ngram'"):
        SpeculativeConfig(method="ngram", suffix_max_depth=4)
    with pytest.raises(ValueError, match="suffix options"):
        SpeculativeConfig(method="draft_model", model="/a/draft", suffix_max_spec_factor=2.0)


def test_k_left_unset_is_the_tree_depth():
    from specserve.spec_decode.factory import resolve_speculative_config

    assert resolve_speculative_config(SpeculativeConfig(method="suffix"), None).num_speculative_tokens == 16
    assert resolve_speculative_config(SpeculativeConfig(method="suffix", suffix_max_depth=6),
                                      None).num_speculative_tokens == 6
    assert resolve_speculative_config(SpeculativeConfig(method="suffix", num_speculative_tokens=3),
                                      None).num_speculative_tokens == 3


def test_cli_flags_reach_the_config():
    import argparse

    from specserve.entrypoints.cli import add_model_args, speculative_config_from_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--speculative-method", "suffix", "--num-speculative-tokens", "6",
                              "--suffix-max-depth", "5", "--suffix-min-token-prob", "0.05",
                              "--suffix-max-cached-requests", "32", "--suffix-max-spec-factor", "1.5"])
    values = speculative_config_from_args(args)
    assert values == {"method": "suffix", "num_speculative_tokens": 6, "suffix_max_depth": 5,
                      "suffix_min_token_prob": 0.05, "suffix_max_cached_requests": 32,
                      "suffix_max_spec_factor": 1.5}
    SpeculativeConfig.from_dict(values)


# ------------------------------------------------------------------ end to end
PROMPTS = ["one two three one two three one two", "the cat sat on the mat the cat sat on the",
           "a b c d a b c d a b c", "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x):",
           "Count: 1, 2, 3, 1, 2, 3, 1, 2,", "hello hello hello hello"]
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "suffix_min_token_prob": 0.0, "suffix_max_spec_factor": 2.0}


def make(model_dir, spec=None, **kw) -> LLM:
    extra = {"speculative_config": spec} if spec else {}
    kw.setdefault("max_model_len", 256)
    return LLM(model=model_dir, dtype="float32", kv_cache_memory=16 << 20, **extra, **kw)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_suffix_decoding_equals_plain(tiny_llama_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = make(tiny_llama_dir)
    spec = make(tiny_llama_dir, SUFFIX)
    want = tokens(plain.generate(PROMPTS, greedy, use_tqdm=False))
    # Batch 1, one after another (later ones see earlier ones' outputs in the global trie) ...
    assert [tokens(spec.generate(p, greedy, use_tqdm=False))[0] for p in PROMPTS] == want
    stats = spec.get_spec_decode_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    # ... and all at once, twice (the second time the global trie holds every answer).
    assert tokens(spec.generate(PROMPTS, greedy, use_tqdm=False)) == want
    before = spec.get_spec_decode_stats().num_accepted_tokens
    assert tokens(spec.generate(PROMPTS, greedy, use_tqdm=False)) == want
    after = spec.get_spec_decode_stats()
    assert after.num_accepted_tokens - before > len(PROMPTS) * 20    # repeated answers: mostly drafted


def test_trees_are_verified(tiny_llama_dir, monkeypatch):
    """Several branches end to end: a proposer told to keep every continuation (min prob 0)
    proposes trees on these prompts, and greedy output is still plain."""
    import specserve.spec_decode.suffix as suffix

    shapes = []
    original = suffix.SuffixProposer.propose

    def spy(self, scheduled):
        proposal = original(self, scheduled)
        shapes.extend(p for p in proposal.parents if p is not None)
        return proposal

    monkeypatch.setattr(suffix.SuffixProposer, "propose", spy)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = tokens(make(tiny_llama_dir).generate(PROMPTS, greedy, use_tqdm=False))
    spec = make(tiny_llama_dir, SUFFIX)
    assert tokens(spec.generate(PROMPTS, greedy, use_tqdm=False)) == want
    assert shapes, "no tree was proposed"


def test_the_largest_trees_fit_the_attention_masks(tiny_llama_dir, monkeypatch):
    """k = MAX_SPECULATIVE_TOKENS: trees of k + 1 = 32 new tokens, the most the CPU attention
    kernel's 32-bit ancestor masks hold (bit 31 included), verify like any other tree."""
    from specserve.config import MAX_SPECULATIVE_TOKENS
    from specserve.worker.model_runner import ModelRunner

    widest = []
    original = ModelRunner.execute

    def spy(self, inputs, *args, **kwargs):
        widest.extend(len(i.token_ids) for i in inputs if i.tree_parents is not None)
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    k = MAX_SPECULATIVE_TOKENS
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = tokens(make(tiny_llama_dir).generate(PROMPTS, greedy, use_tqdm=False))
    spec = make(tiny_llama_dir, {**SUFFIX, "num_speculative_tokens": k, "suffix_max_depth": k,
                                 "suffix_max_spec_factor": 64.0, "dynamic_k": False})
    assert tokens(spec.generate(PROMPTS, greedy, use_tqdm=False)) == want
    assert tokens(spec.generate(PROMPTS, greedy, use_tqdm=False)) == want   # the global trie holds the answers
    assert max(widest) == k + 1 == 32


N = 600
PAIR_PROMPT = [50, 1000, 1001, 1002, 1003, 1004, 1005, 60, 1003, 1004, 1005, 1000, 70, 1001, 1002]
FAVOURED = [1000, 1001, 1002, 1003, 1004, 1005]


@pytest.mark.slow   # a distribution test of many seeded requests (about 20 s)
def test_sampled_pairs_match_plain_sampling(tiny_llama_dir):
    """Seeded sampled requests (a logit bias concentrates them on six tokens that the prompt
    and earlier answers repeat, so drafts are proposed and often accepted): with other seeds
    than plain sampling's, the pairs (token 2, token 3) and (token 3, token 4) are distributed
    as under plain sampling; with the same seeds they are plain sampling's."""
    def params(seed):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True,
                              logit_bias={t: 14.0 for t in FAVOURED})

    def run(llm, first_seed=0):
        outs = llm.generate([PAIR_PROMPT] * N, [params(first_seed + s) for s in range(N)], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    plain = run(make(tiny_llama_dir, max_model_len=64, max_num_seqs=128))
    llm = make(tiny_llama_dir, {"method": "suffix", "num_speculative_tokens": 3}, max_model_len=64,
               max_num_seqs=128)
    spec = run(llm, first_seed=N)
    stats = llm.get_spec_decode_stats()
    assert stats.num_draft_tokens > N and stats.num_accepted_tokens > N / 10
    for at in (1, 2):
        assert pair_p_value(plain, spec, at) > 1e-3, at
    assert run(llm) == plain