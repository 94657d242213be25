"""A step's grammar masks computed in one batched llguidance call (and in a background thread)
are the masks computed one prefix at a time, every matcher is left where it stood, a failing
grammar fails its own request only, and the engine's greedy output under a schema is the same
with the masks overlapped with the forward as without."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams, StructuredOutput
from specserve.structured_output.compiler import GrammarCompiler, request_grammar
from specserve.structured_output.matcher import GrammarLimitError
from specserve.structured_output.step_masks import StepMasks

from json_schemas import SCHEMAS

SCHEMA = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "w": {"type": "boolean"}, "s": {"enum": ["abc", "abd"]}},
          "required": ["v", "w", "s"], "additionalProperties": False}
TEXT = '{"v": 3, "w": true, "s": "abd"}'


@pytest.fixture(scope="module")
def compiler(default_model_tokenizer):
    tok = default_model_tokenizer
    return GrammarCompiler(tok, len(tok), tok.eos_token_id)


def ids(compiler, text: str) -> list[int]:
    return compiler.tokenizer.encode(text, add_special_tokens=False)


def one_by_one(g, chain: list[int]) -> torch.Tensor:
    return torch.stack([g.mask_after(chain[:i]) for i in range(len(chain) + 1)])


@pytest.mark.parametrize("overlap", [False, True])
def test_planned_rows_equal_rows_one_prefix_at_a_time(compiler, overlap, monkeypatch):
    """Overlapped: one batched llguidance call (no fallback to row by row); inline: row by row."""
    import specserve.structured_output.step_masks as step_masks

    if overlap:
        def no_fallback(g):
            raise AssertionError("the batched call failed and the rows were computed one by one")

        monkeypatch.setattr(step_masks, "_chain_rows_one_by_one", no_fallback)
    else:
        monkeypatch.setattr(step_masks.StepMasks, "_chains_at_once",
                            lambda self, gs: (_ for _ in ()).throw(AssertionError("batched on a CPU")))
    text = ids(compiler, TEXT) + [compiler.eos_token_id]
    cases = [(0, 0), (0, 5), (3, 4), (0, len(text)), (len(text) - 4, 4)]   # (emitted, drafts)
    grammars, chains = [], []
    for emitted, n in cases:
        g = request_grammar(compiler, StructuredOutput(json_schema=SCHEMA))
        g.advance(text[:emitted])
        chain = text[emitted : emitted + n]
        g.plan_chain_rows(chain, repeat_last=1)
        grammars.append(g)
        chains.append(chain)
    masks = StepMasks(overlap=overlap)
    masks.start([(str(i), g) for i, g in enumerate(grammars)])
    masks.wait()
    for g, chain in zip(grammars, chains):
        expected = one_by_one(g, chain)
        assert g.step_bitmask.shape[0] == len(chain) + 2
        assert torch.equal(g.step_bitmask[:-1], expected)
        assert torch.equal(g.step_bitmask[-1], expected[-1])          # the repeated row
        assert g.valid_prefix(chain) == len(chain)                    # the matcher stood still
        g._masks.clear()
        assert torch.equal(g.mask_after([]), expected[0])


def test_tree_rows_are_each_paths_mask(compiler):
    text = ids(compiler, TEXT)
    g = request_grammar(compiler, StructuredOutput(json_schema=SCHEMA))
    paths = [text[:1], text[:2], text[:3]]
    g.plan_tree_rows(paths)
    masks = StepMasks(overlap=True)
    masks.start([("r", g)])
    masks.wait()
    assert torch.equal(g.step_bitmask, torch.stack([g.mask_after([])] + [g.mask_after(p) for p in paths]))


def test_a_grammar_out_of_its_limit_ends_its_own_request(compiler, monkeypatch):
    text = ids(compiler, TEXT)
    good, bad = (request_grammar(compiler, StructuredOutput(json_schema=SCHEMA)) for _ in range(2))
    good.plan_chain_rows(text[:3])
    bad.plan_chain_rows(text[:3])
    real = type(bad).mask_after

    def failing(self, prefix):
        if self is bad:
            raise GrammarLimitError("out of fuel")
        return real(self, prefix)

    monkeypatch.setattr(type(bad), "mask_after", failing)
    monkeypatch.setattr(StepMasks, "_chains_at_once", lambda self, gs: (_ for _ in ()).throw(RuntimeError("x")))
    for overlap in (True, False):       # the batched call's failure falls back to row by row
        good.plan_chain_rows(text[:3])
        bad.plan_chain_rows(text[:3])
        bad.exhausted = False
        masks = StepMasks(overlap=overlap)
        masks.start([("good", good), ("bad", bad)])
        masks.wait()
        assert good.step_bitmask.shape[0] == 4 and not good.exhausted
        assert bad.exhausted and bad.failed is None
        allowed = bad.step_bitmask.nonzero()
        assert bad.step_bitmask.shape[0] == 4 and set(allowed[:, 1].tolist()) == {compiler.eos_token_id // 32}


@pytest.mark.usefixtures("one_torch_thread")
def test_greedy_output_is_the_same_with_masks_overlapped(tiny_llama_dir):
    names = list(SCHEMAS)[:8]
    params = [SamplingParams(temperature=0, max_tokens=120, structured_output=StructuredOutput(json_schema=SCHEMAS[n]))
              for n in names]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": False}
    texts = {}
    for overlap in (False, True):
        llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=512, kv_cache_memory=32 << 20,
                  speculative_config=spec)
        llm.engine.constraints.masks = StepMasks(overlap=overlap)
        outs = llm.generate(["Answer in JSON: "] * len(names), params, use_tqdm=False)
        texts[overlap] = [o.outputs[0].token_ids for o in outs]
    assert texts[True] == texts[False]
