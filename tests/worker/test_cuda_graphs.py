"""Decode and verification steps through ``cuda_graphs.StepGraphs``: the padded static-tensor
forward a CUDA graph replays, run eagerly on a CPU (``SPECSERVE_GRAPHS_ON_CPU=1``, attention
by the Triton kernel in Triton's interpreter). Capture itself needs a GPU:
tests/e2e/test_cuda.py."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.bench.graph_checks import graph_and_eager, greedy_steps
from specserve.model_executor.layers import cpu_attention
from specserve.worker.cuda_graphs import Bucket
from specserve.worker.model_runner import ForwardInput, ModelRunner

from model_families import FAMILIES, VOCAB, WINDOWED, tiny_model
from tiny_models import write_tiny_eagle, write_tiny_llama
from triton_interpreter import use_triton_interpreter

BLOCK = 16


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Attention by the Triton kernel, and graphs' padded forwards, on this CPU."""
    monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    use_triton_interpreter(monkeypatch)
    monkeypatch.setenv("SPECSERVE_GRAPHS_ON_CPU", "1")


@pytest.fixture(scope="module")
def peaked_llama(tmp_path_factory, default_model_tokenizer) -> str:
    """A tiny Llama whose next token stands out (greedy answers do not hang on rounding)."""
    return write_tiny_llama(str(tmp_path_factory.mktemp("peaked")), seed=3, tokenizer=default_model_tokenizer,
                            embedding_scale=8.0)


def _llm(model, **kw) -> LLM:
    return LLM(model=model, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=1 << 22, max_num_seqs=6, **kw)


def _step(runner, shapes, seed=0):
    """ForwardInputs of requests with (cached, new) tokens over disjoint blocks of the runner's cache
    (whose cached K/V are random)."""
    gen = torch.Generator().manual_seed(seed)
    for cache in runner.kv_caches:
        cache[:, :, : runner.num_blocks].normal_(generator=gen)
    inputs, next_block = [], 0
    for cached, new in shapes:
        n_blocks = -(-(cached + new) // BLOCK)
        table = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        ids = torch.randint(0, 1000, (new,), generator=gen).tolist()
        inputs.append(ForwardInput(ids, cached, table, new))
    return inputs


def test_graph_steps_equal_eager_steps_and_padding_never_leaks(graphs_on_cpu, peaked_llama):
    """Steps of 1-3 requests with 1-5 new tokens each (so padded requests and padded rows) give
    the eager forward's logits, hidden states and cache contents; padding writes only the
    padding block."""
    llm = _llm(peaked_llama, num_speculative_tokens=4, speculative_config={"method": "ngram"})
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.padding_block == runner.num_blocks
    for shapes in ([(20, 1), (5, 1), (9, 1)], [(20, 5), (3, 2), (40, 1)], [(0, 4), (17, 3)]):
        inputs = _step(runner, shapes, seed=len(shapes))
        bucket = runner.graphs.bucket_for(inputs)
        assert bucket is not None and bucket.rows > sum(n for _, n in shapes)   # padding in every one
        both = graph_and_eager(runner, inputs, return_all_hidden=True)
        torch.testing.assert_close(both.graphed.logits, both.eager.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(both.graphed.all_hidden, both.eager.all_hidden, rtol=1e-5, atol=1e-5)
        for c_graph, c_eager in zip(both.graphed_cache, both.eager_cache):
            # the real blocks hold the same K/V; only the padding block may differ
            torch.testing.assert_close(c_graph[:, :, : runner.num_blocks], c_eager[:, :, : runner.num_blocks],
                                       rtol=1e-5, atol=1e-5)


def test_a_tree_step_through_a_graph_equals_the_eager_step(graphs_on_cpu, peaked_llama):
    """A verification step holding a tree of drafts (its ancestor masks packed into the graph's
    mask words) beside a chain and a decode: the eager step's logits."""
    llm = _llm(peaked_llama, num_speculative_tokens=5, speculative_config={"method": "ngram"})
    runner = llm.engine.runner
    inputs = _step(runner, [(30, 6), (12, 3), (50, 1)], seed=9)
    inputs[0].tree_parents = [-1, 0, 0, 1, 2, 1]
    assert runner.graphs.bucket_for(inputs) == Bucket(4, 6)
    both = graph_and_eager(runner, inputs)
    torch.testing.assert_close(both.graphed.logits, both.eager.logits, rtol=1e-5, atol=1e-5)


def test_a_greedy_chain_equals_step_by_step_decoding(graphs_on_cpu, peaked_llama):
    """Requests chaining 4, 2 and 3 greedy steps in one graph (the draft model's drafts 2..k): each
    request's tokens and the K/V at its fed positions are those of decoding it step by step; the
    steps past a request's budget write only the padding block."""
    llm = _llm(peaked_llama)
    runner = llm.engine.runner
    runner.use_graphs(6, 1, 0, max_chain_steps=4)
    steps = [4, 2, 3]
    inputs = _step(runner, [(30, 4), (12, 2), (50, 3)], seed=11)   # blocks up to each request's last step
    firsts = [inp.token_ids[0] for inp in inputs]
    positions = [inp.start_position for inp in inputs]
    tables = [inp.block_table for inp in inputs]
    before = [c.clone() for c in runner.kv_caches]
    bucket = runner.graphs.chain_bucket(3, 4)
    assert bucket == 4 and runner.graphs.chain_bucket(3, 5) is None
    chained = runner.graphs.greedy_chain(bucket, firsts, positions, tables, steps)
    after_chain = [c.clone() for c in runner.kv_caches]
    for c, b in zip(runner.kv_caches, before):
        c.copy_(b)
    graphs, runner.graphs = runner.graphs, None
    stepped = [greedy_steps(runner, *step) for step in zip(firsts, positions, tables, steps)]
    runner.graphs = graphs
    assert chained == stepped
    for c_chain, c_steps in zip(after_chain, runner.kv_caches):
        torch.testing.assert_close(c_chain[:, :, : runner.num_blocks], c_steps[:, :, : runner.num_blocks],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow   # six engines in Triton's interpreter; the fast tier keeps the step-level tests above
def test_greedy_answers_with_graphs_are_the_eager_ones(graphs_on_cpu, peaked_llama, tiny_draft_dir):
    """Plain decoding, n-gram and draft-model speculation with graphs give the tokens of the same
    engine with enforce_eager=True, and speculation gives plain's."""
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown", "1, 2, 3, 4, 5,", "Hello"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    answers, accepted = {}, {}
    for name, kw in {"plain": {}, "ngram": {"speculative_config": {"method": "ngram"}, "num_speculative_tokens": 3},
                     "draft": {"speculative_model": tiny_draft_dir, "num_speculative_tokens": 3}}.items():
        for eager in (False, True):
            llm = _llm(peaked_llama, enforce_eager=eager, **kw)
            assert (llm.engine.runner.graphs is None) == eager
            answers[name, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.get_spec_decode_stats()
            accepted[name, eager] = (stats.num_draft_tokens, stats.num_accepted_tokens)
            if not eager:
                assert llm.engine.runner.graphs.captured, "no step ran through a graph"
                if name == "draft":
                    draft_graphs = llm.engine.proposer.runner.graphs
                    assert draft_graphs.captured, "the draft's steps ran eagerly"
                    assert draft_graphs.chains, "drafts 2..k ran step by step, not as one greedy chain"
    for key, tokens in answers.items():
        assert tokens == answers["plain", True], key
    assert accepted["draft", False] == accepted["draft", True]    # the chain drafted exactly what steps draft
    assert accepted["ngram", False] == accepted["ngram", True]


@pytest.fixture(scope="module")
def peaked_eagle(tmp_path_factory, peaked_llama) -> str:
    """An EAGLE head made from the peaked model's last layer."""
    return write_tiny_eagle(str(tmp_path_factory.mktemp("peaked-eagle")), peaked_llama)


def test_eagle_drafts_greedy_chains_in_one_graph(graphs_on_cpu, peaked_llama, peaked_eagle):
    """EAGLE's drafts 2..k through StepGraphs with its own chain step (the head's output feature
    carried on the device): the drafts, acceptances and answers of enforce_eager."""
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown", "1, 2, 3, 4, 5,"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "eagle", "model": peaked_eagle, "num_speculative_tokens": 3}
    runs = {}
    for eager in (False, True):
        llm = _llm(peaked_llama, enforce_eager=eager, speculative_config=spec)
        proposer = llm.engine.proposer
        assert (proposer.graphs is None) == eager
        proposals = []
        propose = proposer.propose
        proposer.propose = lambda scheduled: proposals.append(propose(scheduled).token_ids) or proposals[-1]
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[eager] = tokens, proposals
        if not eager:
            assert proposer.graphs.chains, "EAGLE's drafts 2..k ran step by step"
    assert runs[False][0] == runs[True][0]
    assert runs[False][1] == runs[True][1]          # every step's drafts, the third included
    assert any(len(d) == 3 for p in runs[True][1] for d in p)


def test_steps_outside_the_buckets_run_eagerly(graphs_on_cpu, peaked_llama):
    llm = _llm(peaked_llama, num_speculative_tokens=3, speculative_config={"method": "ngram"})
    graphs = llm.engine.runner.graphs
    assert graphs.batch_buckets == [1, 2, 4, 6] and graphs.query_buckets == [1, 2, 3, 4]
    one = ForwardInput([1], 10, [0], 1)
    assert graphs.bucket_for([one] * 3) == Bucket(4, 1)
    assert graphs.bucket_for([ForwardInput([1, 2, 3], 10, [0], 3), one]) == Bucket(2, 3)
    assert graphs.bucket_for([one] * 7) is None                                   # more requests than buckets
    assert graphs.bucket_for([ForwardInput(list(range(5)), 0, [0], 1)]) is None   # a prefill chunk
    tree = ForwardInput([1, 2, 3], 10, [0], 3, tree_parents=[-1, 0, 0])
    assert graphs.bucket_for([tree]) == Bucket(1, 3)
    wide = ForwardInput([1, 2, 3], 40, [0, 1, 2], 3, tree_parents=[-1] + list(range(32)) + [-1, 0, 0], tree_cached=33)
    assert graphs.bucket_for([wide]) is None                                      # wider than the mask words


def test_positions_past_the_model_length_are_refused_as_eagerly(graphs_on_cpu, peaked_llama):
    """A graph step checks positions as the eager step does: a tree node's is its depth's, not its slot's."""
    llm = _llm(peaked_llama, num_speculative_tokens=3, speculative_config={"method": "ngram"})
    runner = llm.engine.runner
    table = list(range(17))
    with pytest.raises(ValueError, match="beyond max_model_len"):
        runner.execute([ForwardInput([1], 256, table, 1)])
    # slots 254..256 (one past the model's 256), positions 254, 255, 255 (inside it)
    tree = ForwardInput([1, 2, 3], 254, table, 3, tree_parents=[-1, 0, 0])
    assert runner.graphs.bucket_for([tree]) is not None
    assert runner.execute([tree]).logits.shape[0] == 3
    with pytest.raises(ValueError, match="beyond max_model_len"):
        runner.execute([ForwardInput([1, 2], 255, table, 2)])


def test_graphs_only_where_asked_and_possible(monkeypatch, peaked_llama):
    """enforce_eager turns them off; a CPU has none unless the tests ask."""
    monkeypatch.delenv("SPECSERVE_GRAPHS_ON_CPU", raising=False)
    assert _llm(peaked_llama).engine.runner.graphs is None
    monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    use_triton_interpreter(monkeypatch)
    monkeypatch.setenv("SPECSERVE_GRAPHS_ON_CPU", "1")
    assert _llm(peaked_llama).engine.runner.graphs is not None
    assert _llm(peaked_llama, enforce_eager=True).engine.runner.graphs is None


# One family per part a captured forward must carry: llama 3 rope scaling, q/k norms per head
# (qwen3) and over the projection (olmo2), soft caps and windows (gemma2), per-layer rotaries
# (gemma3), partial rotary and fused weights (phi3), multipliers (granite), NoPE layers (smollm3).
GRAPH_FAMILIES = ["llama3", "qwen3", "olmo2", "gemma2", "gemma3", "phi3", "granite", "smollm3"]


@pytest.mark.slow   # breadth over families (no real model): the fast tier keeps the Llama-shaped tests above
@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_families_through_graphs(graphs_on_cpu, family):
    """Each family's decode, verification and tree steps through graphs equal its eager steps.
    Where a sliding window is no wider than the tree mask words, tree steps run eagerly."""
    assert family in FAMILIES
    hf = tiny_model(family)
    runner = ModelRunner(hf.config, hf.state_dict(), torch.float32, torch.device("cpu"), 256, BLOCK)
    runner.allocate_kv_cache(24, padding_block=True)
    runner.use_graphs(4, 6, max_tree_span=6)
    windowed = family in WINDOWED
    assert (runner.graphs.max_tree_span == 0) == windowed
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 23)]
    tables = [[0, 1, 2, 3], [4, 5, 6]]
    graphs, runner.graphs = runner.graphs, None
    for ids, table in zip(prompts, tables):   # prefill, eagerly
        runner.execute([ForwardInput(ids, 0, table, 1)])
    runner.graphs = graphs
    steps = [
        [ForwardInput([5], 40, tables[0], 1), ForwardInput([6], 23, tables[1], 1)],               # decode
        [ForwardInput([5, 7, 9, 11, 13], 40, tables[0], 5), ForwardInput([6, 8], 23, tables[1], 2)],  # verify
        [ForwardInput([5, 7, 9, 11], 40, tables[0], 4, tree_parents=[-1, 0, 0, 1]),
         ForwardInput([6], 23, tables[1], 1)],                                                     # a tree
    ]
    for i, inputs in enumerate(steps):
        served = graphs.bucket_for(inputs) is not None
        assert served == (i < 2 or not windowed), i
        both = graph_and_eager(runner, inputs)
        torch.testing.assert_close(both.graphed.logits, both.eager.logits, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"step {i}: {m}")
