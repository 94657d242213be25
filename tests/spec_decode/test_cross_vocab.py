"""Drafts with another tokenizer, end to end on tiny random models.

The target is the tiny Llama on the default model's byte-level BPE. Two drafts:

- ``sp_draft``: a tiny random Llama on a small Gemma-like vocabulary (``cross_vocab_models
  .sentencepiece_style``): '▁' spaces, ``<0xNN>`` byte pieces, a BOS, pieces that cross the
  target's token boundaries and words the target has as one token spelled in several; it
  rarely agrees with the target, so it mostly exercises rejection;
- ``mimic_draft``: the target itself read through a changed copy of its vocabulary (half its
  whole-word tokens gone, ids reversed, a shadow token beside each one:
  ``cross_vocab_models.write_mimic_draft``), which agrees with the target often.

Greedy output equals plain output under both methods, with boundary-case prompts (half
characters, emoji, chat specials, code), penalties, stop strings, prefix caching,
``dynamic_k``, preemption and a draft KV pool too small for every request; seeded samples
equal plain decoding's samples for the same seeds (their tokens are the target's own
choices), random text exercising every kind of byte. The sampled distribution
of each method, with the power check, is in ``test_distribution_per_method`` (slow tier).
"""
from __future__ import annotations

import collections
import gc

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.core.kv_cache_manager import KVCacheManager
from specserve.spec_decode import cross_vocab
from specserve.spec_decode.cross_vocab import CrossVocabProposer
from specserve.spec_decode.draft_model import DraftModelProposer
from specserve.worker.model_runner import ForwardInput

from chi_square import chi_square_p
from cross_vocab_models import sentencepiece_style, write_mimic_draft
from dynamic_k_setup import catch_up_counts
from model_cache import share_folder
from tiny_models import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=1 << 24)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def sp_draft(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("sp-draft"))
    return share_folder(write_tiny_llama(folder, seed=3, tokenizer=sentencepiece_style(), embedding_scale=4.0))


@pytest.fixture(scope="module")
def mimic_draft(tmp_path_factory, tiny_llama_dir) -> str:
    return share_folder(write_mimic_draft(str(tmp_path_factory.mktemp("mimic-draft")), tiny_llama_dir))


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> LLM:
    return LLM(model=tiny_llama_dir, **KW)


@pytest.fixture(scope="module")
def prompts(plain) -> list:
    tok = plain.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}], tokenize=False,
                                   add_generation_prompt=True)
    half = tok.encode("Hi ") + tok.convert_tokens_to_ids(["ä½"])     # ends inside '你'
    return ["Hello, my", "Café 你好 🙂 déjà vu", "def add(a, b):\n    return a + b\n", chat, half,
            "The quick brown fox jumps over the lazy dog. The quick brown"]


def speculative(target: str, draft: str, method: str | None, k: int = 3, **extra) -> LLM:
    return LLM(model=target, **{**KW, **extra.pop("engine", {})},
               speculative_config={"model": draft, "num_speculative_tokens": k, "cross_vocab": method, **extra})


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["slem", "tli"])
@pytest.mark.parametrize("which", ["sp_draft", "mimic_draft"])
def test_greedy_equals_plain(request, tiny_llama_dir, plain, prompts, which, method):
    draft = request.getfixturevalue(which)
    ref = generate(plain, prompts, GREEDY)
    llm = speculative(tiny_llama_dir, draft, method)
    assert isinstance(llm.engine.proposer, CrossVocabProposer) and llm.engine.proposer.method == method
    assert generate(llm, prompts, GREEDY) == ref
    stats = llm.get_spec_decode_stats()
    assert stats.num_draft_tokens > 0
    if which == "mimic_draft":   # the target itself, through another vocabulary: often right
        assert stats.num_accepted_tokens > 0.25 * stats.num_draft_tokens


@pytest.mark.parametrize("method", ["slem", "tli"])
def test_seeded_samples_equal_plain_samples(tiny_llama_dir, plain, sp_draft, prompts, method):
    """Random text of every kind of token (half characters, rare bytes, EOS) at temperature 1:
    a seeded request's tokens are plain decoding's for its seed, whatever was drafted (two
    samples each: n = 2 runs two requests, each drafting for itself)."""
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=16, n=2) for i in range(len(prompts))]
    llm = speculative(tiny_llama_dir, sp_draft, method)

    def samples(engine):
        return [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params, use_tqdm=False)]

    assert samples(llm) == samples(plain)
    assert llm.get_spec_decode_stats().num_draft_tokens > 0


@pytest.mark.parametrize("method", ["slem", "tli"])
def test_a_draft_vocabulary_cut_to_its_first_ids(tiny_llama_dir, plain, sp_draft, prompts, method):
    """``draft_vocab_size`` keeps the draft's LM head to its first ids (the rest is never drafted)."""
    llm = speculative(tiny_llama_dir, sp_draft, method, draft_vocab_size=300)
    assert generate(llm, prompts, GREEDY) == generate(plain, prompts, GREEDY)
    assert llm.get_spec_decode_stats().num_draft_tokens > 0


def test_tli_computes_the_shared_tokens_logits_only(tiny_llama_dir, sp_draft, monkeypatch):
    """TLI's draft LM head is cut to the draft's tokens with a target twin; the rows it proposes
    from are the whole head's, bit for bit (SLEM, which drafts from every token, keeps it whole)."""
    cut = speculative(tiny_llama_dir, sp_draft, "tli").engine.proposer
    assert not speculative(tiny_llama_dir, sp_draft, "slem").engine.proposer.head_is_shared
    monkeypatch.setattr(CrossVocabProposer, "CUT_DRAFT_HEAD", False)
    whole = speculative(tiny_llama_dir, sp_draft, "tli").engine.proposer
    assert cut.head_is_shared and not whole.head_is_shared
    assert cut.runner.model.lm_head.vocab_size == cut.shared_draft.numel() < cut.draft_vocab
    inp = [ForwardInput(list(range(5, 25)), 0, [0, 1], 2)]   # the last 2 positions' logits
    rows = [p.target_logits(p.runner.execute(inp).logits) for p in (cut, whole)]
    assert rows[0].shape == (2, cut.target_vocab) and torch.equal(rows[0], rows[1])


def test_the_default_method_and_a_same_vocabulary_draft(tiny_llama_dir, tiny_draft_dir, sp_draft):
    assert speculative(tiny_llama_dir, sp_draft, None).engine.proposer.method == cross_vocab.DEFAULT_METHOD
    assert isinstance(speculative(tiny_llama_dir, tiny_draft_dir, None).engine.proposer, DraftModelProposer)
    forced = speculative(tiny_llama_dir, tiny_draft_dir, "tli").engine.proposer
    assert isinstance(forced, CrossVocabProposer) and forced.twins   # the target's tokens, read one to one


def test_penalties_stops_prefix_caching_and_dynamic_k(tiny_llama_dir, plain, mimic_draft, prompts):
    params = [SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.3, presence_penalty=0.5,
                             stop=[" Teens", "ll"], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=32, frequency_penalty=0.8, logit_bias={1450: 5.0})]
    params = [params[i % 2] for i in range(len(prompts))]
    ref = [o.outputs[0] for o in plain.generate(prompts * 2, params * 2, use_tqdm=False)]
    llm = speculative(tiny_llama_dir, mimic_draft, "tli", dynamic_k=True, engine={"enable_prefix_caching": True})
    for _ in range(2):                  # the second round finds the prompts in the prefix cache
        outs = [o.outputs[0] for o in llm.generate(prompts * 2, params * 2, use_tqdm=False)]
        assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == \
            [(o.token_ids, o.text, o.finish_reason) for o in ref]
    assert llm.engine.kv_cache.prefix_cache_stats()["hits"] > 0


@pytest.mark.parametrize("method", ["slem", "tli"])
def test_preemption_and_a_small_draft_pool(tiny_llama_dir, plain, mimic_draft, prompts, method):
    """Twelve requests in a target cache of 12 blocks (preemption by recompute) and a draft pool
    of 8 (requests outside a step give their draft KV up, read it again later): plain's tokens,
    and every draft block back once the requests are gone."""
    many = (prompts * 2)[:12]
    ref = generate(plain, many, GREEDY)
    bytes_per_block = plain.engine.runner.bytes_per_block
    llm = speculative(tiny_llama_dir, mimic_draft, method,
                      engine={"kv_cache_memory": 12 * bytes_per_block, "max_model_len": 128})
    proposer = llm.engine.proposer
    proposer.blocks = KVCacheManager(8, proposer.blocks.block_size)
    outs = llm.generate(many, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0 and proposer.num_evictions > 0
    del outs
    gc.collect()
    proposer._free_released()
    assert proposer.blocks.num_free_blocks == 8


# ------------------------------------------------------------------ the sampled distribution (slow)
def test_catch_up_tokens_are_what_the_draft_has_not_read(tiny_llama_dir, mimic_draft, monkeypatch):
    """dynamic_k prices a probe by ``catch_up_tokens``: the whole prompt before the first
    proposal, then at most what one verification emits (k + 1), as the draft reads each step."""
    llm = speculative(tiny_llama_dir, mimic_draft, "tli", k=3)
    (tokens, first), *later = seen = catch_up_counts(llm, monkeypatch, "one two three four five six", max_tokens=12)
    assert first == tokens and later and all(1 <= n <= 4 for _, n in later), seen


@pytest.fixture(scope="module")
def peaked_pair(tmp_path_factory, default_model_tokenizer):
    """A target whose next token is peaked enough for a chi-square test, and its mimic draft."""
    target = write_tiny_llama(str(tmp_path_factory.mktemp("peaked")), seed=0, tokenizer=default_model_tokenizer,
                              embedding_scale=8.0)
    return target, write_mimic_draft(str(tmp_path_factory.mktemp("peaked-mimic")), target)


def second_tokens(llm: LLM, prompt: list[int], seeds) -> list[int]:
    # max_tokens=3: with one token out the scheduler leaves room for one draft, so the second
    # token is the first verified one.
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in seeds]
    return [o.outputs[0].token_ids[1] for o in llm.generate([prompt] * len(seeds), params, use_tqdm=False)]


def ignoring_the_intersection(monkeypatch, proposer: CrossVocabProposer) -> None:
    """TLI's drafts, verified as if the draft's probabilities were not renormalized to the tokens
    both vocabularies share (q = the draft's own probabilities of those tokens): wrong."""
    real_rows, real_choose, shared_mass = proposer.target_logits, cross_vocab.choose_tokens, {}

    def rows(draft_logits):
        shared_mass["z"] = draft_logits.softmax(-1).index_select(1, proposer.shared_draft).sum(-1, keepdim=True)
        return real_rows(draft_logits)

    def choose(logits, params, generators):
        choice = real_choose(logits, params, generators)
        if choice.probs is not None:
            choice.probs = choice.probs * shared_mass["z"]
        return choice

    monkeypatch.setattr(proposer, "target_logits", rows)
    monkeypatch.setattr(cross_vocab, "choose_tokens", choose)


@pytest.mark.slow
def test_distribution_per_method(peaked_pair, monkeypatch):
    """At temperature 1, the first verified token has plain decoding's distribution under each
    method, by a chi-square test of the tokens and of whether each has a twin in the draft's
    vocabulary (the set TLI restricts the draft to). TLI's unseeded requests go through the
    rejection sampler with the draft's probabilities; SLEM's one-hot drafts through the target's
    choices (other seeds than plain's run: the same seeds give the same tokens).

    Power: verifying TLI's drafts with probabilities not renormalized to the shared tokens
    accepts them too often, which the twin statistic rejects at p < 1e-6 (measured ~1e-10: 90%
    of the tokens with a twin instead of 69%). 300 requests per run; p > 1e-3 leaves a false
    alarm once in a thousand runs per statistic. About 15 s."""
    target, draft = peaked_pair
    plain = LLM(model=target, **KW)
    prompt = plain.get_tokenizer().encode("The best")
    n = 300
    ref = second_tokens(plain, prompt, range(n))
    for method in ("tli", "slem", "ignoring"):
        if method == "ignoring":   # it reads the draft's whole row: its LM head stays whole
            monkeypatch.setattr(CrossVocabProposer, "CUT_DRAFT_HEAD", False)
        llm = speculative(target, draft, "tli" if method == "ignoring" else method)
        proposer = llm.engine.proposer
        if method == "ignoring":
            ignoring_the_intersection(monkeypatch, proposer)
        seeds = [None] * n if method != "slem" else range(10**6, 10**6 + n)   # None: the rejection sampler
        got = second_tokens(llm, prompt, seeds)
        twin = proposer.mapping.target_to_draft
        p_twin = chi_square_p([twin[t] >= 0 for t in ref], [twin[t] >= 0 for t in got])
        if method == "ignoring":
            assert p_twin < 1e-6, p_twin
            continue
        p_tokens = chi_square_p(ref, got)
        assert p_tokens > 1e-3 and p_twin > 1e-3, (method, p_tokens, p_twin, collections.Counter(got).most_common(5))
        stats = llm.get_spec_decode_stats()
        assert stats.num_draft_tokens == n and stats.num_accepted_tokens > 0
