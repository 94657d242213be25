"""EAGLE: the proposer against a reference, and lossless output on the default model.

The first tests use a tiny random target (and an EAGLE head built from it) and
run in seconds: the drafts the proposer makes inside the engine (paged KV cache,
catch-up after rejections, its own outputs fed back as features, preemption)
must be what the same head computes over the whole sequence at once. The
others use the default model in float32 with the head shipped in
specserve/drafts/ (picked when no EAGLE model is named): greedy output equals
plain output token for token, and sampling keeps the target's distribution.
"""
from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from specserve import LLM, SamplingParams
from specserve.config import DEFAULT_SPECULATIVE_TOKENS, SpeculativeConfig
from specserve.drafts import SHIPPED, shipped_draft
from specserve.model_executor.loader import load_model
from specserve.model_executor.models.eagle import EagleConfig, load_eagle_head
from specserve.spec_decode.factory import resolve_speculative_config
from specserve.core.request import Request
from specserve.spec_decode.proposer import Proposer, TargetHidden
from specserve.training.data import FeatureRecorder
from specserve.training.train_eagle import EagleTask

from cached_prefix_kv import kv_at_positions, prompts_parting_after_four_blocks
from model_cache import share_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- tiny target
@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_tokenizer):
    """(target folder, EAGLE folder): a random 2-layer target and a head made from its last layer."""
    root = tmp_path_factory.mktemp("eagle-tiny")
    target = str(root / "target")
    tokenizer = default_model_tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    share_folder(target)   # the engines below read its tokenizer once
    loaded = load_model(target, torch.float32)
    task = EagleTask(loaded.config, loaded.state_dict, torch.arange(0, 49152, 7), "tiny")
    with torch.no_grad():  # make it a head whose drafts depend on both of its inputs
        task.module.fc.weight.add_(0.3 * torch.randn_like(task.module.fc.weight))
    eagle = str(root / "eagle")
    task.export(eagle, {})
    return target, eagle


def test_unrolled_training_sees_what_drafting_a_second_token_sees(tiny):
    """h2[:, j] = the head at position j with its own h1[:, j-1] as the feature there and
    the target's features before j (as in the drafting loop of the test below)."""
    _, eagle_dir = tiny
    head = load_eagle_head(eagle_dir, torch.float32)
    torch.manual_seed(1)
    hidden = head.config.hidden_size
    feats, embeds = torch.randn(2, 9, hidden), torch.randn(2, 9, hidden)
    with torch.no_grad():
        h1, h2 = head.forward_train_unrolled(feats, embeds)
        torch.testing.assert_close(h1, head.forward_train(feats, embeds))
        for j in range(1, 9):
            own = torch.cat([feats[:, :j], h1[:, j - 1 : j]], dim=1)
            want = head.forward_train(own, embeds[:, : j + 1])[:, j]
            torch.testing.assert_close(h2[:, j], want, rtol=1e-4, atol=1e-5)


class Recording(Proposer):
    """Wraps a proposer and records (tokens so far, num_computed_tokens, drafts) per proposal."""

    needs_target_hidden = True

    def __init__(self, inner):
        self.inner = inner
        self.log = []

    def propose(self, scheduled):
        proposal = self.inner.propose(scheduled)
        for s, drafts in zip(scheduled, proposal.token_ids):
            self.log.append((list(s.request.all_token_ids), s.request.num_computed_tokens, list(drafts)))
        return proposal

    def observe(self, states):
        self.inner.observe(states)


def _target_features(target: str, tokens: list[int]) -> torch.Tensor:
    llm = LLM(model=target, dtype="float32", device="cpu", kv_cache_memory=16 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    recorder = FeatureRecorder(torch.float32)
    llm.engine.proposer = recorder
    out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1))[0]
    return recorder.pop(out.request_id)                                  # [len(tokens), H]


def test_drafts_match_a_whole_sequence_reference(tiny):
    target, eagle_dir = tiny
    llm = LLM(model=target, dtype="float32", device="cpu", kv_cache_memory=16 << 20,
              speculative_config={"method": "eagle", "model": eagle_dir, "num_speculative_tokens": 3})
    rec = Recording(llm.engine.proposer)
    llm.engine.proposer = rec
    out = llm.generate("Tell me a story about a dragon", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    full = out.prompt_token_ids + out.outputs[0].token_ids
    feats = _target_features(target, full)
    head = load_eagle_head(eagle_dir, torch.float32)
    embed = load_model(target, torch.float32).state_dict["model.embed_tokens.weight"]
    lm = embed[head.draft_vocab]
    assert len(rec.log) > 3
    with torch.no_grad():
        for tokens, n, drafts in rec.log:
            f = feats[:n].clone()                    # real features at positions 0..n-1
            x = list(tokens[1 : n + 1])              # the token after each position
            for d in drafts:
                h = head.forward_train(f[None], F.embedding(torch.tensor([x]), embed))[0, -1]
                logits = lm @ h
                # The proposer's choice is the reference's argmax (up to float noise between the two kernels).
                chosen = logits[(head.draft_vocab == d).nonzero()[0, 0]]
                assert chosen >= logits.max() - 1e-3, (n, drafts)
                f = torch.cat([f, h[None]])          # the head's own output is the next feature
                x.append(d)


def test_greedy_lossless_with_rejections_and_preemption(tiny):
    """A KV cache too small for all requests at once: preempted requests recompute, the head too."""
    target, eagle_dir = tiny
    prompts = ["Hi", "Tell me a story", "What is two plus two?", "Write a poem about the sea"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=target, dtype="float32", device="cpu", kv_cache_memory=16 << 20).generate(prompts, params)
    # 2 layers x 2 KV heads x 16 dims x fp32 x (K, V) = 512 bytes per token: 10 blocks of 16 tokens.
    small = LLM(model=target, dtype="float32", device="cpu", kv_cache_memory=10 * 16 * 512, max_model_len=128,
                speculative_config={"method": "eagle", "model": eagle_dir, "num_speculative_tokens": 3})
    got = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]



@pytest.mark.parametrize("children", ["topk", "sampled"])
def test_eagle_trees_are_lossless_with_preemption(tiny, children):
    """EAGLE trees (spec_decode/draft_tree.py) under a KV cache too small for every request: greedy
    output is plain output, trees are verified, and the head keeps the target's hidden states of
    the accepted branch's rows (not of the tree's first slots)."""
    target, eagle_dir = tiny
    prompts = ["Hi", "Tell me a story", "What is two plus two?", "Write a poem about the sea"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=target, dtype="float32", device="cpu", kv_cache_memory=16 << 20).generate(prompts, params)
    small = LLM(model=target, dtype="float32", device="cpu", kv_cache_memory=10 * 16 * 512, max_model_len=128,
                speculative_config={"method": "eagle", "model": eagle_dir, "num_speculative_tokens": 3,
                                    "tree": {"top_k": 3, "max_nodes": 10, "children": children}})
    got = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics["num_preemptions"] for o in got) > 0
    stats = small.get_spec_decode_stats()   # (this head's vocabulary is every 7th token: few accepted)
    assert stats.num_draft_tokens > 2 * stats.num_drafts and len(stats.drafted_per_position) >= 2
    proposer = small.engine.proposer
    req = Request("r", None, [1, 2, 3], SamplingParams(max_tokens=8), None, None)
    req.num_computed_tokens = 5 + 3                  # the last token (position 5) and two drafts kept
    tree_rows = torch.randn(7, 16)                   # [last token, 6 drafts] the target's hidden states
    proposer.keep_tree_branch(req, [1, 4], last=5)
    proposer.observe([TargetHidden(req, 5, tree_rows[:0], tree_rows)])
    assert torch.equal(proposer.features[req].get(5, 8), tree_rows[[0, 2, 5]])

def _head_kv_at_first_drafts(llm: LLM) -> dict[tuple, tuple[torch.Tensor, int]]:
    """Wraps the engine's EAGLE proposer: per prompt, the head's K/V [2, Hk, n, hd] at positions
    0..n-1 just after its first catch-up (n = the tokens the target has computed then), and the
    prompt tokens the request found cached."""
    proposer, seen = llm.engine.proposer, {}
    real = proposer._catch_up

    def catch_up(reqs, budgets):
        out = real(reqs, budgets)
        for r in reqs:
            key = tuple(r.prompt_token_ids)
            if key not in seen and r.proposer_num_computed_tokens:
                table = proposer.kv_cache.block_table(r.request_id)
                seen[key] = (kv_at_positions(proposer.kv, table, r.proposer_num_computed_tokens, proposer.block_size),
                             r.num_cached_tokens)
        return out

    proposer._catch_up = catch_up
    return seen


@pytest.mark.parametrize("chunk", [None, 24], ids=["whole-prefill", "prefill-in-chunks-of-24"])
def test_a_cached_prefix_brings_the_heads_kv_as_computed_without_caching(tiny, chunk):
    """Prefix caching shares the head's K/V along with the target's blocks (core/kv_cache_manager.py).
    One after another: A (prompt P) stops after its first token, never drafting: its head computes
    its positions as it finishes, so its blocks are shared; B (prompt P again) finds them all; C
    shares them and differs from P at the 5th block's first token, which the head K/V at position
    63 has read, so C copies the 4th block but for position 63 and computes that one again. At B's
    and C's first drafts the head's K/V at every position equals an uncached engine's, with prompts
    prefilled whole or in chunks (the head follows each chunk)."""
    target, eagle_dir = tiny
    spec = {"method": "eagle", "model": eagle_dir, "num_speculative_tokens": 3}
    prompt_b, prompt_c = prompts_parting_after_four_blocks()
    kv_of = {}
    for caching in (True, False):
        chunked = {"max_num_batched_tokens": chunk} if chunk else {}
        llm = LLM(model=target, dtype="float32", device="cpu", kv_cache_memory=16 << 20, speculative_config=spec,
                  enable_prefix_caching=caching, **chunked)
        assert llm.engine.kv_cache.proposer_kv == ("from_features" if caching else None)
        kv_of[caching] = _head_kv_at_first_drafts(llm)
        for prompt, max_tokens in ((prompt_b, 1), (prompt_b, 6), (prompt_c, 6)):
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
    assert [kv_of[True][tuple(p)][1] for p in (prompt_b, prompt_c)] == [64, 63]   # B: 4 blocks; C: 4 blocks but 1 token
    for prompt in (prompt_b, prompt_c):   # (chunked, the first drafts may come with the prompt's last token)
        got, want = kv_of[True][tuple(prompt)][0], kv_of[False][tuple(prompt)][0]
        n = min(got.shape[2], want.shape[2])
        assert n >= 72
        torch.testing.assert_close(got[:, :, :n], want[:, :, :n], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- default model
PROMPTS = [
    "Write a short poem about the sea.",
    "What is the difference between weather and climate?",
    "Give me three tips for learning to cook.",
    "Explain what a compiler does in two sentences.",
]
KW = dict(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def plain():
    return LLM(**KW)


@pytest.fixture(scope="module")
def eagle():
    return LLM(**KW, speculative_config={"method": "eagle", "num_speculative_tokens": 4})


def test_shipped_drafts_are_found():
    for method, name in SHIPPED.items():
        path = shipped_draft(method, None)
        assert path.endswith(name) and os.path.isdir(path)
    config = EagleConfig.load(shipped_draft("eagle", None))
    assert config.vocab_size == 49152 and config.hidden_size == 576
    with pytest.raises(ValueError, match="train-draft"):
        shipped_draft("eagle", "/some/other/model")


def test_k_left_unset_comes_from_the_draft():
    """The shipped EAGLE head recommends its own k; other drafts and ngram get the default."""
    eagle_k = EagleConfig.load(shipped_draft("eagle", None)).num_speculative_tokens
    assert eagle_k is not None
    resolved = resolve_speculative_config(SpeculativeConfig(method="eagle"), None)
    assert resolved.num_speculative_tokens == eagle_k and resolved.model == shipped_draft("eagle", None)
    assert resolve_speculative_config(SpeculativeConfig(method="eagle", num_speculative_tokens=3),
                                      None).num_speculative_tokens == 3
    for method in ("draft_model", "ngram"):
        assert resolve_speculative_config(SpeculativeConfig(method=method), None).num_speculative_tokens == \
            DEFAULT_SPECULATIVE_TOKENS
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)


@pytest.mark.slow
def test_greedy_equals_plain_batch_1_and_4(plain, eagle):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [plain.apply_chat_template([{"role": "user", "content": t}]) for t in PROMPTS]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in eagle.generate(prompts, params)] == want       # batch 4
    assert eagle.generate(prompts[:1], params)[0].outputs[0].token_ids == want[0]         # batch 1
    stats = eagle.get_spec_decode_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


@pytest.mark.slow
def test_sampling_matches_the_target(plain, eagle):
    """Second generated token (the first one that went through verification), speculative vs
    plain: a chi-square two-sample test on a few hundred seeded samples."""
    scipy_stats = pytest.importorskip("scipy.stats")
    n = 160
    prompt = plain.engine.tokenize("Once upon a")

    def second_tokens(llm, seed0):
        # max_tokens=3 leaves room for one draft token after the first (prefill) token.
        params = [SamplingParams(temperature=0.8, top_k=6, max_tokens=3, ignore_eos=True, seed=seed0 + i)
                  for i in range(n)]
        return [o.outputs[0].token_ids[1] for o in llm.generate([prompt] * n, params, use_tqdm=False)]

    before = eagle.get_spec_decode_stats().num_draft_tokens
    a = Counter(second_tokens(plain, 0))
    b = Counter(second_tokens(eagle, 100_000))
    assert eagle.get_spec_decode_stats().num_draft_tokens >= before + n
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]    # pool rare tokens into one column
    rows = [[c[t] for t in common] + [n - sum(c[t] for t in common)] for c in (a, b)]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    p_value = scipy_stats.chi2_contingency(rows)[1]
    assert p_value > 1e-3, (rows, p_value)
