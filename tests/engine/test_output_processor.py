"""Appending tokens: the text grows by decoding only the newest tokens, and still equals the
whole output decoded, split UTF-8 characters included; stop strings are found in it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.core.request import Request, RequestStatus
from specserve.engine.output_processor import OutputProcessor
from specserve.model_executor.loader import load_model
from specserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return load_model(None, torch.float32, load_weights=False).tokenizer


class CountingTokenizer:
    """The real tokenizer, recording how many tokens each decode call gets."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kw)


TEXT = "Déjà vu: 🙂 naïve café, 漢字 and more text " * 20


def test_text_grows_incrementally_and_matches_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    proc = OutputProcessor(counting, max_model_len=4096)
    req = Request("r", None, [1], SamplingParams(max_tokens=len(ids), stop=["never appears"]), None, None)
    for i, t in enumerate(ids):
        status = proc.append(req, t)
        partial = proc.make_output(req).outputs[0].text
        assert "\ufffd" not in partial
        assert tokenizer.decode(ids[: i + 1]).startswith(partial)
    assert status is RequestStatus.FINISHED_LENGTH
    req.status = status
    assert proc.make_output(req).outputs[0].text == tokenizer.decode(ids) == TEXT
    # every decode but the final whole-output one saw only a few tokens
    assert max(counting.lengths[:-1]) <= 8 and counting.lengths[-1] == len(ids)


@pytest.mark.parametrize("include", [False, True], ids=["cut-before", "include_stop_str_in_output"])
def test_a_stop_string_split_over_tokens_cuts_the_text_before_it(tokenizer, include):
    ids = tokenizer.encode("one two three STOP four five", add_special_tokens=False)
    proc = OutputProcessor(tokenizer, max_model_len=4096)
    params = SamplingParams(max_tokens=100, stop=["TOP f"], include_stop_str_in_output=include)
    req = Request("r", None, [1], params, None, None)
    for stopped_at, t in enumerate(ids):
        status = proc.append(req, t)
        if status is not None:
            break
    assert status is RequestStatus.FINISHED_STOPPED and req.stop_reason == "TOP f"
    assert req.output_text == ("one two three STOP f" if include else "one two three S")
    assert tokenizer.decode(ids[: stopped_at + 1]).startswith("one two three STOP f")
    req.status = status
    assert proc.make_output(req).outputs[0].text == req.output_text


def test_an_end_of_sequence_under_a_constraint_ends_the_request_even_with_ignore_eos(tokenizer):
    """A constraint allows the end of sequence only once it is complete, so with ignore_eos that
    token still ends the request, and the tokens a verification step accepted after it (drafts that
    repeat it) are dropped: found by tests/engine/test_mixed_workload.py, where an n-gram draft
    repeated it and the output had two."""
    eos = 2
    proc = OutputProcessor(tokenizer, max_model_len=4096)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    free = Request("free", None, [1], params, None, eos)
    assert proc.append(free, eos) is None                      # ignore_eos alone: an ordinary token
    bound = Request("bound", None, [1], params, None, eos)
    bound.grammar = object()                                  # any constraint attached
    verified = SimpleNamespace(token_ids=[300, eos, eos, 301], logprobs=None, sources=["target"] * 4)
    status, appended = proc.append_verified(bound, verified)
    assert status is RequestStatus.FINISHED_STOPPED and appended == 2 and bound.stop_reason is None
    assert bound.output_token_ids == [300, eos]
