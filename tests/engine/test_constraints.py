"""The engine's structured-output step (engine/constraints.py) with scripted drafts on the tiny
random model: a rejected draft never moves the matcher, drafts are cut at their first invalid
token before the forward, a constraint that cannot finish ends with "length", a failing grammar
fails its request alone, and preempted, sampled-n and refused requests behave."""
from __future__ import annotations

import json

import pytest

from specserve import LLM, SamplingParams, StructuredOutput
from specserve.spec_decode.proposer import Proposal, Proposer
from specserve.structured_output.bitmask import allowed_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {"type": "object",
          "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 99}, "w": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["v", "w", "tags"], "additionalProperties": False}
PROMPT = "JSON: "
K = 4


def constrained(temperature: float = 0.0, max_tokens: int = 64, schema=SCHEMA, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          structured_output=StructuredOutput(json_schema=schema), **kw)


class Scripted(Proposer):
    def __init__(self, script):
        self.script = script

    def propose(self, scheduled) -> Proposal:
        return Proposal([self.script(s.request, s.num_lookahead) for s in scheduled], [None] * len(scheduled))


def make(tiny_llama_dir, script=None, grammar_drafts=False, **kw) -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": K, "grammar_drafts": grammar_drafts}
    kw = dict(dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20), **kw)
    if script is None:
        return LLM(model=tiny_llama_dir, **kw)
    return LLM(model=tiny_llama_dir, speculative_config=spec, proposer=Scripted(script), **kw)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    llm = make(tiny_llama_dir)
    return llm, llm.generate(PROMPT, constrained(), use_tqdm=False)[0].outputs[0]


def allowed_now(req) -> list[int]:
    mask = req.grammar.mask_after([]).unsqueeze(0)
    return allowed_tokens(mask, req.grammar.vocab_size)[0].nonzero().flatten().tolist()


def test_a_rejected_draft_never_moves_the_matcher(tiny_llama_dir, plain):
    """Each step drafts a token the grammar allows but the target will not pick, then what the
    grammar forces after it: valid drafts, all rejected at the first. Had the matcher moved with
    them, the next step's masks would be a wrong state's and the output would differ or break."""
    _, expected = plain
    truth = expected.token_ids
    checked = []

    def script(req, n):
        at = req.num_output_tokens
        if at >= len(truth) - 1:
            return []
        g = req.grammar
        # The matcher stands exactly after the output: plain decoding's continuation is valid.
        assert g.valid_prefix(truth[at:]) == len(truth) - at
        other = next((t for t in allowed_now(req) if t != truth[at] and t != req.eos_token_id), None)
        if other is None:     # a forced position: nothing else to draft
            return []
        checked.append(at)
        return ([other] + g.forced_after([other]))[:n]

    llm = make(tiny_llama_dir, script)
    out = llm.generate(PROMPT, constrained(), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == truth
    stats = llm.get_spec_decode_stats()
    assert len(checked) >= 3 and stats.num_draft_tokens >= len(checked) and stats.num_accepted_tokens == 0
    json.loads(out.text)


def test_drafts_are_cut_at_their_first_invalid_token(tiny_llama_dir, plain):
    """Drafts: the plain continuation with its third token replaced by one the grammar forbids.
    Only the two valid ones are verified (the forward's rows show it), and both are accepted."""
    _, expected = plain
    truth = expected.token_ids
    bad_token = 30000

    def script(req, n):
        at = req.num_output_tokens
        drafts = truth[at : at + n]
        if len(drafts) < 3:
            return drafts
        assert req.grammar.valid_prefix(drafts[:2] + [bad_token]) == 2
        return drafts[:2] + [bad_token] + drafts[3:]

    llm = make(tiny_llama_dir, script)
    rows = []
    real_execute = llm.engine.runner.execute

    def execute(inputs, **kw):
        rows.extend(len(i.token_ids) for i in inputs if i.num_logits)
        return real_execute(inputs, **kw)

    llm.engine.runner.execute = execute
    out = llm.generate(PROMPT, constrained(), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == truth
    assert max(rows) == 3                       # the last token and two drafts, never the invalid one
    stats = llm.get_spec_decode_stats()
    assert stats.num_draft_tokens == stats.num_accepted_tokens > 0


def test_forced_drafts_fill_the_lookahead(tiny_llama_dir, plain):
    """With grammar_drafts a proposer that drafts nothing still verifies the schema's boilerplate."""
    _, expected = plain
    llm = make(tiny_llama_dir, lambda req, n: [], grammar_drafts=True)
    out = llm.generate(PROMPT, constrained(), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected.token_ids
    stats = llm.get_spec_decode_stats()
    assert stats.num_draft_tokens >= 5 and stats.num_accepted_tokens >= 5
    assert len(out.token_ids) > stats.num_steps + 4     # fewer steps than tokens


def test_no_forced_drafts_where_speculation_is_disabled_by_batch_size(tiny_llama_dir, plain):
    _, expected = plain
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
              speculative_config={"method": "grammar", "num_speculative_tokens": K, "disable_by_batch_size": 1})
    out = llm.generate(PROMPT, constrained(), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected.token_ids and llm.get_spec_decode_stats().num_draft_tokens == 0


def test_a_constraint_that_cannot_finish_ends_with_length(tiny_llama_dir):
    llm = make(tiny_llama_dir)
    out = llm.generate(PROMPT, constrained(max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    endless = SamplingParams(temperature=0, max_tokens=12, structured_output=StructuredOutput(grammar='start: "ab"+'))
    out = llm.generate(PROMPT, endless, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and set(out.text.replace("ab", "")) == set()


def test_an_invalid_constraint_is_refused_before_anything_is_queued(tiny_llama_dir):
    llm = make(tiny_llama_dir)
    for bad in ({"json_schema": {"type": "nope"}}, {"regex": "(a"}, {"grammar": "root ::= missing"}):
        with pytest.raises(ValueError, match="invalid"):
            llm.engine.add_request(PROMPT, SamplingParams(structured_output=bad))
    assert not llm.engine.has_unfinished_requests()


def test_a_failing_grammar_fails_its_request_alone(tiny_llama_dir, monkeypatch):
    import specserve.engine.constraints as constraints

    real = constraints.fit_drafts

    def fit(req, room):
        if req.sampling_params.max_tokens == 33 and req.num_output_tokens == 3:
            raise RuntimeError("out of lexer fuel")
        real(req, room)

    monkeypatch.setattr(constraints, "fit_drafts", fit)
    llm = make(tiny_llama_dir)
    outs = llm.generate([PROMPT] * 3, [constrained(max_tokens=64), constrained(max_tokens=33), constrained(max_tokens=64)],
                        use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "error", "stop"]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_preempted_constrained_requests_give_their_unpreempted_output(tiny_llama_dir):
    """Preemption recomputes a request from its tokens; its matcher stands after its output,
    which is kept, so nothing is rebuilt and the output is the one it gets alone."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 20, "maxItems": 24}
    params = [constrained(temperature=0.8, seed=i, max_tokens=120, schema=schema) for i in range(8)]
    roomy = make(tiny_llama_dir)
    alone = [roomy.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].token_ids for p in params]
    small = make(tiny_llama_dir, kv_cache_memory=16 * roomy.engine.runner.bytes_per_block)
    outs = small.generate([PROMPT] * 8, params, use_tqdm=False)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_n_samples_each_follow_the_constraint(tiny_llama_dir):
    llm = make(tiny_llama_dir)
    out = llm.generate(PROMPT, constrained(temperature=1.0, n=4, seed=7), use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1
    for t in texts:
        value = json.loads(t)
        assert set(value) == {"v", "w", "tags"}


def test_a_regex_that_explodes_is_refused_or_cut_never_the_engine(tiny_llama_dir):
    """Counted repetitions of counted repetitions run out of the lexer's limits at the first
    token: refused when compiled. A Unicode class repeated 500 times runs out later, after a
    few words: that request ends with "length" (its grammar cannot go on within its bounds)
    and the request beside it is untouched."""
    llm = make(tiny_llama_dir)
    with pytest.raises(ValueError, match="too complex"):
        llm.engine.add_request(PROMPT, SamplingParams(structured_output={"regex": "a{1000}{1000}"}))
    words = SamplingParams(temperature=1.0, seed=1, max_tokens=100, structured_output={"regex": r"(\w+\s?){1,500}\."})
    outs = llm.generate([PROMPT, PROMPT], [words, constrained()], use_tqdm=False)
    cut, normal = outs[0].outputs[0], outs[1].outputs[0]
    assert cut.finish_reason == "length" and 0 < len(cut.token_ids) < 100
    assert normal.finish_reason == "stop"
    assert normal.token_ids == llm.generate(PROMPT, constrained(), use_tqdm=False)[0].outputs[0].token_ids
