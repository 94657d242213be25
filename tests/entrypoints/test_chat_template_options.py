"""vLLM's chat options, in ``LLM.chat``/``apply_chat_template`` and over HTTP (chat completions and
/tokenize) alike: ``continue_final_message`` leaves the last assistant message open for the answer
to go on from, ``chat_template_kwargs`` reach the template as variables; misuse is a ValueError in
the library and a 400 naming the field on the server; a template of one's own replaces the model's
(``chat_template``, ``--chat-template``). Tiny random model with the default model's tokenizer,
and a template of the test's own for the variables."""
from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.entrypoints.chat_template import template_takes_tools
from specserve.entrypoints.cli import build_parser, main
from specserve.entrypoints.engine_args import build_llm
from specserve.entrypoints.openai.api_server import build_app

from proposer_specs import tiny_engine
from server_util import local_http, running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
CONVERSATION = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
# a template that shows a variable, as Qwen3's shows enable_thinking
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}{% if enable_thinking %}<think>{% endif %}")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return tiny_engine(tiny_llama_dir, max_model_len=256)


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    served = tiny_engine(tiny_llama_dir, max_model_len=256)
    with running_server(build_app(served, MODEL)) as base:
        yield base


def text_of(llm, ids) -> str:
    return llm.get_tokenizer().decode(ids)


def test_continue_final_message_leaves_the_answer_open(llm):
    closed = text_of(llm, llm.apply_chat_template(CONVERSATION, add_generation_prompt=False))
    opened = text_of(llm, llm.apply_chat_template(CONVERSATION, add_generation_prompt=False,
                                                  continue_final_message=True))
    assert opened.endswith("The colour is") and closed.startswith(opened) and len(closed) > len(opened)
    [out] = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=3), add_generation_prompt=False,
                     continue_final_message=True)
    assert text_of(llm, out.prompt_token_ids) == opened
    with pytest.raises(ValueError, match="needs add_generation_prompt false"):
        llm.apply_chat_template(CONVERSATION, continue_final_message=True)
    with pytest.raises(ValueError, match="assistant message last"):
        llm.apply_chat_template(CONVERSATION[:1], add_generation_prompt=False, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template(llm, monkeypatch):
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", TEMPLATE)
    plain = text_of(llm, llm.apply_chat_template(CONVERSATION[:1]))
    thinking = text_of(llm, llm.apply_chat_template(CONVERSATION[:1], chat_template_kwargs={"enable_thinking": True}))
    assert plain == "<user>Name a colour.<assistant>" and thinking == plain + "<think>"
    with pytest.raises(ValueError, match="may not set"):
        llm.apply_chat_template(CONVERSATION[:1], chat_template_kwargs={"tokenize": True})


def test_the_server_takes_both_options(url, llm):
    body = {"model": MODEL, "messages": CONVERSATION, "add_generation_prompt": False,
            "continue_final_message": True}
    r = local_http.post(f"{url}/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    want = llm.apply_chat_template(CONVERSATION, add_generation_prompt=False, continue_final_message=True)
    assert r.json()["tokens"] == want
    r = local_http.post(f"{url}/v1/chat/completions", json=dict(body, max_tokens=2, temperature=0), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
    for bad, param in [(dict(body, add_generation_prompt=True), "continue_final_message"),
                       (dict(body, messages=CONVERSATION[:1]), "continue_final_message"),
                       (dict(body, chat_template_kwargs={"add_generation_prompt": True}), "chat_template_kwargs"),
                       (dict(body, chat_template_kwargs=["x"]), "chat_template_kwargs")]:
        r = local_http.post(f"{url}/v1/chat/completions", json=dict(bad, max_tokens=2), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = local_http.post(f"{url}/v1/chat/completions",
                        json={"model": MODEL, "messages": CONVERSATION[:1], "max_tokens": 2,
                              "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_model_without_a_chat_template_is_told_to_send_a_plain_prompt(llm, monkeypatch):
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template; send a plain prompt"):
        llm.chat(CONVERSATION[:1], SamplingParams(max_tokens=2))


def test_a_template_of_ones_own_replaces_the_models(llm, tmp_path, monkeypatch):
    """vLLM's ``chat_template``: the Jinja text itself or a file; it works for a model without one."""
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", None)
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    for given in (TEMPLATE, str(path)):
        assert text_of(llm, llm.apply_chat_template(CONVERSATION[:1], chat_template=given)) == (
            "<user>Name a colour.<assistant>")
    [out] = llm.chat(CONVERSATION[:1], SamplingParams(temperature=0, max_tokens=2), chat_template=str(path))
    assert text_of(llm, out.prompt_token_ids) == "<user>Name a colour.<assistant>"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        llm.apply_chat_template(CONVERSATION[:1], chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="cannot render a one-message conversation"):
        llm.apply_chat_template(CONVERSATION[:1], chat_template="{% if %}")


def test_the_chat_template_flag_sets_the_template_every_chat_path_reads(tiny_llama_dir, tmp_path, capsys):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    args = build_parser().parse_args(["serve", "--model", tiny_llama_dir, "--dtype", "float32",
                                      "--kv-cache-memory", str(8 << 20), "--chat-template", str(path)])
    served = build_llm(args)
    assert served.get_tokenizer().chat_template == TEMPLATE
    with running_server(build_app(served, MODEL)) as base:
        r = local_http.post(f"{base}/tokenize", json={"model": MODEL, "messages": CONVERSATION[:1]}, timeout=60)
    assert r.status_code == 200 and served.get_tokenizer().decode(r.json()["tokens"]) == (
        "<user>Name a colour.<assistant>"), r.text
    code = main(["generate", "x", "--chat", "--model", tiny_llama_dir, "--chat-template", "{% if %}"])
    assert code == 2 and "cannot render a one-message conversation" in capsys.readouterr().err


def test_tools_reach_a_template_that_takes_them(llm, monkeypatch):
    """vLLM's ``LLM.chat(tools=...)``: OpenAI's function definitions go to the template; a
    template without tools says so rather than dropping them."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template",
                        TEMPLATE + "{% for t in tools or [] %}<tool>{{ t['function']['name'] }}{% endfor %}")
    text = text_of(llm, llm.apply_chat_template(CONVERSATION[:1], tools=tools))
    assert text == "<user>Name a colour.<assistant><tool>get_weather"
    [out] = llm.chat(CONVERSATION[:1], SamplingParams(temperature=0, max_tokens=2), tools=tools)
    assert text_of(llm, out.prompt_token_ids) == text
    with pytest.raises(ValueError, match="does not take tools"):
        llm.apply_chat_template(CONVERSATION[:1], tools=tools, chat_template=TEMPLATE)


def test_a_tokenizer_with_named_templates_takes_tools_where_one_does():
    class Named:   # transformers keeps several templates as a dict, e.g. "default" and "tool_use"
        chat_template = {"default": TEMPLATE, "tool_use": "{{ tools }}"}

    assert template_takes_tools(Named()) and not template_takes_tools(Named(), TEMPLATE)


def test_content_as_openais_list_of_text_parts_renders_as_its_text(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    assert llm.apply_chat_template(parts) == llm.apply_chat_template(CONVERSATION[:1])
    with pytest.raises(ValueError, match="content parts must all be"):
        llm.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_reasoning_effort_reaches_the_template(tiny_llama_dir):
    """OpenAI's reasoning_effort (and the Responses API's reasoning.effort) is the template's
    reasoning_effort variable, as in vLLM; chat_template_kwargs may set it instead."""
    from specserve.entrypoints.openai.protocol import ChatCompletionRequest

    served = tiny_engine(tiny_llama_dir, max_model_len=256)
    served.get_tokenizer().chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                            "{% if reasoning_effort %} effort {{ reasoning_effort }}{% endif %}")
    with running_server(build_app(served, MODEL)) as base:
        def prompt_tokens(path, **fields):
            body = {"model": MODEL, "temperature": 0, **fields}
            body.update({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                        if path == "chat/completions" else {"input": "hi", "max_output_tokens": 1})
            r = local_http.post(f"{base}/v1/{path}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            return usage.get("prompt_tokens", usage.get("input_tokens"))

        plain = prompt_tokens("chat/completions")
        high = prompt_tokens("chat/completions", reasoning_effort="high")
        assert high > plain
        assert prompt_tokens("responses", reasoning={"effort": "high"}) == high
        assert prompt_tokens("responses") == plain
    both = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], reasoning_effort="low",
                                 chat_template_kwargs={"reasoning_effort": "high"})
    assert both.template_kwargs() == {"reasoning_effort": "high"}
