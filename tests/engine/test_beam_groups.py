"""Beam search through the engine (engine/beam_groups.py, ``LLM.beam_search``), tiny random models:

- the beams and scores of transformers' ``num_beams`` search (float32; scores within 1e-4 or 1e-5 relative), EOS and
  early stopping included;
- with speculation (n-gram chains and trees, suffix, a draft model's and EAGLE's chains and trees, a
  draft with another tokenizer by both methods) the beams, every token's
  log-probability and the cumulative ones equal plain beam search's bit for bit in the CPU
  default dtype, with passes that commit several depths;
- beams share their prefix's KV blocks; a forked beam gets its parent's EAGLE K/V and target
  features; preemption, other requests in the same steps and aborts change nothing else.

The target is a tiny random one-layer Llama (so that an EAGLE head can be an exact copy of it) with large logits (``embedding_scale``: it repeats itself, so
n-gram lookups hit) and its EOS embedding scaled up, so that beams end on EOS and searches stop
early. About half a minute on a shared 2-core machine.
"""
from __future__ import annotations

import collections
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams
from specserve.beam_search_params import BeamSearchParams
from specserve.entrypoints.llm import beam_search_output
from specserve.model_executor.layers.attention import cache_slot
from specserve.spec_decode.proposer import Proposal, Proposer

from model_cache import share_folder
from cross_vocab_models import write_mimic_draft
from tiny_models import write_tiny_eagle, write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS_SCALE = 6.0


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, default_model_tokenizer) -> str:
    folder = write_tiny_llama(str(tmp_path_factory.mktemp("beam-target")), seed=3,
                              tokenizer=default_model_tokenizer, embedding_scale=8.0, num_layers=1)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    eos = json.load(open(os.path.join(folder, "config.json")))["eos_token_id"]
    name = next(n for n in weights if "embed_tokens" in n)
    weights[name][eos] *= EOS_SCALE          # tied: EOS's logit grows with it
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return share_folder(folder)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, target_dir) -> str:
    """An EAGLE head that is the one-layer target itself: its drafts are each beam's greedy path."""
    return write_tiny_eagle(str(tmp_path_factory.mktemp("beam-eagle")), target_dir, exact=True)


@pytest.fixture(scope="module")
def mimic_dir(tmp_path_factory, target_dir) -> str:
    """The target read through another vocabulary (tests/cross_vocab_models.py): a draft with
    another tokenizer that agrees with the target often."""
    return write_mimic_draft(str(tmp_path_factory.mktemp("beam-mimic")), target_dir)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 3000) for _ in range(12)] for _ in range(n)]


def make(model_dir: str, spec: dict | None = None, dtype: str = "auto", **kw) -> LLM:
    return LLM(model=model_dir, dtype=dtype, max_model_len=kw.pop("max_model_len", 256),
               kv_cache_memory=kw.pop("kv_cache_memory", 8 << 20), speculative_config=spec, **kw)


def beams(outputs) -> list[list[tuple]]:
    """Everything a beam search returns, per prompt and beam (floats compared exactly)."""
    return [[(s.tokens, [lp.logprob for d in s.logprobs for lp in d.values()], s.cum_logprob, s.score,
              s.finish_reason, s.text) for s in o.sequences] for o in outputs]


def run_to_end(engine, limit: int = 2000) -> dict:
    """Step ``engine`` until every request is done -> {request id: its last output}; fails past
    ``limit`` steps, so that a search that stops advancing fails the test instead of hanging it."""
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < limit, "the requests stopped advancing"
        done.update((out.request_id, out) for out in engine.step())
    return done


@pytest.mark.parametrize("length_penalty,early_stopping", [(0.0, False), (1.0, True), (-1.0, "never"), (2.0, False)])
def test_the_beams_and_scores_of_transformers_num_beams(target_dir, length_penalty, early_stopping):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    eos = model.config.eos_token_id
    llm = make(target_dir, dtype="float32")
    params = BeamSearchParams(beam_width=4, max_tokens=16, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    ended_on_eos = 0
    for prompt, ours in zip(prompts(6), llm.beam_search(prompts(6), params)):
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=4, num_return_sequences=4, max_new_tokens=16, do_sample=False,
                             length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                             pad_token_id=eos, output_scores=True, return_dict_in_generate=True)
        for seq, score, mine in zip(out.sequences, out.sequences_scores.tolist(), ours.sequences):
            generated = seq[len(prompt):].tolist()
            if eos in generated:
                generated = generated[: generated.index(eos) + 1]
            assert mine.tokens[len(prompt):] == generated
            assert mine.score == pytest.approx(score, rel=1e-5, abs=1e-4)   # float32 sums there
            assert mine.cum_logprob == pytest.approx(score * len(generated) ** length_penalty, rel=1e-5, abs=1e-4)
            ended_on_eos += generated[-1] == eos
    if length_penalty <= 0:
        assert ended_on_eos > 0      # the comparison covered finished hypotheses, not only max_tokens


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "ngram-tree": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_tree": True},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft-model": {"method": "draft_model", "num_speculative_tokens": 3},
    "draft-tree": {"method": "draft_model", "num_speculative_tokens": 3, "tree": {"top_k": 2, "max_nodes": 8}},
    "draft-dynamic-k": {"method": "draft_model", "num_speculative_tokens": 3, "dynamic_k": True},
    "ngram-dynamic-k": {"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": True},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle-tree": {"method": "eagle", "num_speculative_tokens": 3, "tree": {"top_k": 2, "max_nodes": 8}},
    "cross-vocab-tli": {"method": "draft_model", "num_speculative_tokens": 3, "cross_vocab": "tli"},
    "cross-vocab-slem": {"method": "draft_model", "num_speculative_tokens": 3, "cross_vocab": "slem"},
}


def spec_config(spec: str | None, request) -> dict | None:
    """SPECS[spec] with its draft: the target itself for a draft model (each beam's own likeliest
    paths), the EAGLE head made from it for EAGLE."""
    if spec is None:
        return None
    config = dict(SPECS[spec])
    if spec.startswith("draft"):
        config["model"] = request.getfixturevalue("target_dir")
    elif spec.startswith("cross-vocab"):
        config["model"] = request.getfixturevalue("mimic_dir")
    elif spec.startswith("eagle"):
        config["model"] = request.getfixturevalue("eagle_dir")
    return config


@pytest.fixture(scope="module")
def plain_beams(target_dir):
    llm = make(target_dir)
    return {lp: beams(llm.beam_search(prompts(4, seed=1), BeamSearchParams(beam_width=4, max_tokens=20,
                                                                             length_penalty=lp)))
            for lp in (0.0, 1.0)}


@pytest.mark.parametrize("spec", list(SPECS))
def test_speculation_gives_plain_beams_bit_for_bit(target_dir, plain_beams, spec, request):
    config = spec_config(spec, request)
    llm = make(target_dir, config)
    for lp, expected in plain_beams.items():
        assert beams(llm.beam_search(prompts(4, seed=1), BeamSearchParams(beam_width=4, max_tokens=20,
                                                                            length_penalty=lp))) == expected
    stats = llm.get_spec_decode_stats()
    if "dynamic_k" not in config:    # dynamic_k drafts by measured costs, which depend on the machine's load
        assert stats.num_accepted_tokens > 0 and stats.mean_acceptance_length > 1.0   # passes of several depths


def test_beams_take_no_dynamic_k_probes(target_dir):
    """With dynamic_k, beams skip the policy's probe steps (a forked beam's draft cache holds
    nothing, so a probe would cost the draft a prefill): here the policy drafts on probes only,
    and every step is a probe, so ordinary requests draft and beams do not."""
    llm = make(target_dir, {"model": target_dir, "num_speculative_tokens": 3, "dynamic_k": True})
    policy = llm.engine.drafting.k_policy
    policy.is_probe_step = lambda step: True
    policy.probe_pays = lambda *args: True
    policy.choose = lambda rates, limits, probe: [k if p else 0 for k, p in zip(limits, probe)]
    llm.generate(prompts(1, seed=2), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    drafted = llm.get_spec_decode_stats().num_draft_tokens
    assert drafted > 0
    llm.beam_search(prompts(2, seed=3), BeamSearchParams(beam_width=3, max_tokens=10))
    assert llm.get_spec_decode_stats().num_draft_tokens == drafted


def test_beams_share_their_prefix_blocks(target_dir):
    llm = make(target_dir, block_size=4)
    engine = llm.engine
    engine.add_beam_search(prompts(1)[0], BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True))
    most_shared = 0
    while engine.has_unfinished_requests():
        engine.step()
        tables = [engine.kv_cache.block_table(b.request.request_id) for g in engine.beams.by_id.values()
                  for b in g.running]
        if len(tables) > 1:
            held = sum(len(t) for t in tables)
            most_shared = max(most_shared, held - len({b for t in tables for b in t}))
    assert most_shared >= 3 * 3        # the 12-token prompt's 3 full blocks, held once by 4 beams
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("spec", [None, "ngram", "draft-model", "eagle"])
def test_preemption_and_other_requests_change_nothing(target_dir, spec, request):
    config = spec_config(spec, request)
    params = BeamSearchParams(beam_width=3, max_tokens=24, ignore_eos=True)
    roomy = make(target_dir, config, max_model_len=64)
    alone = beams(roomy.beam_search(prompts(3, seed=2), params))
    sample = SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True)
    sample_alone = roomy.generate(prompts(1, seed=9)[0], sample, use_tqdm=False)[0].outputs[0].token_ids
    small = make(target_dir, config, max_model_len=64, kv_cache_memory=14 * roomy.engine.runner.bytes_per_block)
    engine = small.engine
    ids = [engine.add_beam_search(p, params) for p in prompts(3, seed=2)]
    other = engine.add_request(prompts(1, seed=9)[0], sample)
    done, preempted, steps = {}, 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "the searches stopped advancing"
        before = {r.request_id: r.num_preemptions for r in engine.scheduler.running}
        for out in engine.step():
            done[out.request_id] = out
        preempted += sum(r.num_preemptions > before.get(r.request_id, r.num_preemptions)
                         for r in engine.scheduler.waiting)
    assert preempted > 0 and engine.beams.num_deferred > 0    # passes waited for a preempted beam
    assert beams([beam_search_output(done[i], params.length_penalty) for i in ids]) == alone
    assert done[other].outputs[0].token_ids == sample_alone
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("spec", ["eagle", "eagle-tree"])
def test_a_forked_beam_gets_its_parents_eagle_state(target_dir, spec, request):
    """After each fork, the new beam's EAGLE K/V below its first uncomputed position equals its
    parent's (shared blocks, and the partial block's copies), and it holds the target's features
    from there to what it has computed, so it drafts at once. Fails if the head's copies or the
    features' hand-over are skipped."""
    llm = make(target_dir, spec_config(spec, request), block_size=4)
    engine, proposer = llm.engine, llm.engine.proposer
    forks = []
    original = proposer.fork

    def recording_fork(parent, child, path, last):
        forks.append((parent, child, last))      # the child's tokens up to position last are the parent's
        original(parent, child, path, last)

    proposer.fork = recording_fork
    engine.add_beam_search(prompts(1, seed=4)[0], BeamSearchParams(beam_width=4, max_tokens=24, ignore_eos=True))
    checked = 0
    bs = engine.kv_cache.block_size
    while engine.has_unfinished_requests():
        forks.clear()
        engine.step()
        for parent, child, last in forks:
            if child.num_computed_tokens == 0:      # no room at the fork: it recomputes its context
                continue
            start = child.proposer_num_computed_tokens    # 0 after the prompt's step: the head had none of it
            assert 0 <= start <= last + 1
            slots = [[cache_slot(engine.kv_cache.block_table(r.request_id), p, bs) for p in range(start)]
                     for r in (parent, child)]
            kv = proposer.kv.view(2, proposer.kv.shape[1], -1, proposer.kv.shape[4])  # [2, Hk, slots, hd]
            assert torch.equal(kv[:, :, slots[0]], kv[:, :, slots[1]])
            assert proposer.features[child].get(start, child.num_computed_tokens) is not None
            checked += start > 0
    assert checked >= 3 and not proposer._warned
    assert llm.get_spec_decode_stats().num_accepted_tokens > 0


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
@pytest.mark.parametrize("spec", ["eagle", "eagle-tree"])
def test_beams_share_a_block_only_where_the_heads_kv_in_it_is_the_same(target_dir, spec, caching, request):
    """An EAGLE head's K/V at position t reads token t + 1, so the last slot of a block that ends
    where beams part differs by beam: a fork must not share that block. After every step, beams
    that hold the same block hold it at the same place and agree on every token up to the one
    after it. Fails if forks share every full block below the point where the beams part (block
    size 4 and a 12-token prompt put the first fork at a block's end)."""
    llm = make(target_dir, spec_config(spec, request), block_size=4, enable_prefix_caching=caching)
    engine, kv = llm.engine, llm.engine.kv_cache
    bs = kv.block_size
    engine.add_beam_search(prompts(1, seed=4)[0], BeamSearchParams(beam_width=4, max_tokens=24, ignore_eos=True))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        holders = collections.defaultdict(list)              # block -> [(beam, index in its table)]
        for r in engine.scheduler.running:
            for i, block in enumerate(kv.block_table(r.request_id)):
                holders[block].append((r, i))
        for block, held in holders.items():
            for (a, i), (b, j) in zip(held, held[1:]):
                assert i == j
                end = (i + 1) * bs + 1                        # the block's tokens and the one after it
                assert a.all_token_ids[:end] == b.all_token_ids[:end], (a.request_id, b.request_id, i)
                checked += 1
    assert checked > 0


def test_searches_that_hold_each_others_blocks_take_turns(target_dir):
    """Three searches whose beams do not all fit at once: each holds blocks for some of its beams
    while the others wait, which would stall them all; the oldest goes first instead."""
    params = BeamSearchParams(beam_width=3, max_tokens=24, ignore_eos=True)
    roomy = make(target_dir, max_model_len=64)
    alone = beams(roomy.beam_search(prompts(3, seed=2), params))
    small = make(target_dir, max_model_len=64, kv_cache_memory=14 * roomy.engine.runner.bytes_per_block)
    engine = small.engine
    ids = [engine.add_beam_search(p, params) for p in prompts(3, seed=2)]
    done = run_to_end(engine)
    assert beams([beam_search_output(done[i], params.length_penalty) for i in ids]) == alone
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_a_tight_token_budget_still_runs_every_beam(target_dir):
    """8 tokens a step for 4 beams with 3 drafts each: the first beams' drafts leave the later
    beams their own tokens, so every pass holds all four (the search stalled here before)."""
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    expected = beams(make(target_dir).beam_search(prompts(1, seed=1), params))
    engine = make(target_dir, SPECS["ngram"], max_num_batched_tokens=8).engine
    rid = engine.add_beam_search(prompts(1, seed=1)[0], params)
    done = run_to_end(engine, limit=500)
    assert beams([beam_search_output(done[rid], params.length_penalty)]) == expected


def test_a_search_the_cache_cannot_hold_fails_alone(target_dir):
    """Four beams of 64 tokens in a 5-block cache: the search fails with a clear error once it
    holds every running request and still waits; a request beside it is answered."""
    roomy = make(target_dir, max_model_len=64)
    engine = make(target_dir, max_model_len=64, kv_cache_memory=5 * roomy.engine.runner.bytes_per_block).engine
    big = engine.add_beam_search(prompts(1)[0], BeamSearchParams(beam_width=4, max_tokens=52, ignore_eos=True))
    other = engine.add_request(prompts(1, seed=9)[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    done = run_to_end(engine)
    assert done[big].outputs[0].finish_reason == "error"
    assert "cannot hold them" in str(engine.request_errors[big])
    assert len(done[other].outputs[0].token_ids) == 8
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_a_forked_beam_keeps_its_parents_cross_vocabulary_draft(target_dir, request):
    """A draft with another tokenizer hands a forked beam its reading and K/V (shared and copied
    blocks of its own pool): the draft then reads far fewer tokens than when each forked beam
    reads its context again, and the beams are the same."""
    runs = {}
    for forking in (True, False):
        llm = make(target_dir, spec_config("cross-vocab-tli", request))
        proposer = llm.engine.proposer
        if not forking:
            proposer.fork = lambda *args: None
        fed, execute = [0], proposer.runner.execute

        def counting(inputs, *args, **kw):
            fed[0] += sum(len(i.token_ids) for i in inputs)
            return execute(inputs, *args, **kw)

        proposer.runner.execute = counting
        found = beams(llm.beam_search(prompts(2, seed=1), BeamSearchParams(beam_width=4, max_tokens=20)))
        runs[forking] = fed[0], found, llm.get_spec_decode_stats().num_accepted_tokens
    assert runs[True][1] == runs[False][1]
    assert runs[True][0] < 0.85 * runs[False][0], runs     # draft tokens fed (measured 444 against 624)
    assert runs[True][2] > 0


def test_abort_ends_every_beam(target_dir):
    llm = make(target_dir, SPECS["ngram"])
    engine = llm.engine
    rid = engine.add_beam_search(prompts(1)[0], BeamSearchParams(beam_width=4, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 4
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


class _HiddenStateProposer(Proposer):
    needs_target_hidden = True

    def propose(self, scheduled):
        return Proposal([[] for _ in scheduled], [None for _ in scheduled])


def test_what_cannot_run_is_refused_before_any_work(target_dir):
    llm = make(target_dir, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.beam_search([prompts(1)[0]], BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="prompt 1"):
        llm.beam_search([prompts(1)[0], [10**7]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    custom = make(target_dir, proposer=_HiddenStateProposer())
    with pytest.raises(ValueError, match="runs with the ngram, suffix, draft_model and eagle"):
        custom.beam_search([prompts(1)[0]], BeamSearchParams(beam_width=2, max_tokens=4))
