"""vLLM's prompt dicts in ``LLM.generate`` and ``LLM.beam_search``: ``{"prompt": text}`` and
``{"prompt_token_ids": ids}`` run as the text and the ids do; any other dict is a clear error that
runs nothing. Tiny random model."""
from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.beam_search_params import BeamSearchParams

from proposer_specs import tiny_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
TEXT = "one two three"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return tiny_engine(tiny_llama_dir)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_dicts_run_as_their_text_and_ids(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    want = tokens(llm.generate([TEXT], GREEDY))
    assert tokens(llm.generate([{"prompt": TEXT}], GREEDY)) == want
    assert tokens(llm.generate({"prompt_token_ids": ids}, GREEDY)) == want   # one dict alone too
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].prompt_token_ids == ids
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    [by_text] = llm.beam_search([TEXT], params)
    [by_ids] = llm.beam_search([{"prompt_token_ids": ids}], params)
    assert [b.tokens for b in by_ids.sequences] == [b.tokens for b in by_text.sequences]


@pytest.mark.parametrize("bad", [{}, {"prompt": TEXT, "prompt_token_ids": [1]}, {"prompt": TEXT, "multi_modal_data": {}}])
def test_any_other_dict_is_a_clear_error_that_runs_nothing(llm, bad):
    for run in (lambda: llm.generate([TEXT, bad], GREEDY), lambda: llm.beam_search([TEXT, bad], BeamSearchParams(2, 3))):
        with pytest.raises(ValueError, match=r"prompt 1: a prompt dict holds either 'prompt' \(text\) or 'prompt_token_ids'"):
            run()
        assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
