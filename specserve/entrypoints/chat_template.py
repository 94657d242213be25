"""A conversation rendered by the model's chat template: the one way ``LLM.chat`` and the
server's chat endpoints (and /tokenize) turn messages into a prompt's text.

vLLM's options: ``continue_final_message`` leaves the last (assistant) message open, so the
answer goes on from its text ("prefilling" the answer) instead of starting a new turn;
``chat_template_kwargs`` reach the template as variables (Qwen3's ``enable_thinking``, for
example). The template writes the special tokens, so its text is tokenized without adding any.
A message's content may be OpenAI's list of text parts (joined); ``tools`` go only to a template
that writes them (``template_takes_tools``; the server writes them itself for the others).

A template of the user's own (vLLM's ``--chat-template`` and ``LLM.chat(chat_template=...)``)
replaces the model's: ``load_chat_template`` reads it from a file or takes the text itself,
and checks that it renders a one-message conversation before any request meets it.
"""
from __future__ import annotations

import os
from typing import Any

# apply_chat_template's own arguments: a template variable may not take their place
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


class ChatTemplateError(ValueError):
    """The options or the conversation do not fit the template; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def load_chat_template(tokenizer, value: str) -> str:
    """The template ``value`` names: a file's text, or ``value`` itself when it holds Jinja
    (``{``); ValueError for a path that does not exist or a template that cannot render one
    user message with ``tokenizer``."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{" in value:
        template = value
    else:
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template (no '{{')")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                      add_generation_prompt=True, chat_template=template)
    except Exception as e:  # noqa: BLE001 - Jinja's syntax and runtime errors alike
        raise ValueError(f"the chat template {value[:80]!r} cannot render a one-message conversation: {e}") from None
    return template


def template_takes_tools(tokenizer, template: str | None = None) -> bool:
    """Whether the template (``template``, else the model's) writes OpenAI's ``tools`` itself;
    a tokenizer may hold several named templates (a dict), any of which may."""
    given = template if template is not None else getattr(tokenizer, "chat_template", None)
    texts = given.values() if isinstance(given, dict) else [given or ""]
    return any("tools" in t for t in texts)


def _with_text_content(conversation: list[dict]) -> list[dict]:
    """Messages whose ``content`` is OpenAI's list of parts get the parts' text joined, as the
    server's messages do (``ChatMessage.to_template_dict``): templates expect a string."""
    out = []
    for m in conversation:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ChatTemplateError("a message's content parts must all be {'type': 'text', 'text': ...}: "
                                        "specserve's models read text only", "messages")
            m = {**m, "content": "".join(p["text"] for p in content)}
        out.append(m)
    return out


def render_chat(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                template_kwargs: dict[str, Any] | None = None, model_name: str | None = None,
                template: str | None = None) -> str:
    """The conversation's prompt text; ChatTemplateError for what the template cannot take
    (``model_name`` names the model in the message when it has no template). ``template``:
    a template used instead of the model's (see ``load_chat_template``)."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"the model {model_name!r} has no chat template; send a plain prompt instead "
                                "(/v1/completions, LLM.generate) or give one (--chat-template)", "messages")
    if continue_final_message:
        if add_generation_prompt:
            raise ChatTemplateError("continue_final_message needs add_generation_prompt false: the answer goes on "
                                    "from the last message instead of starting a new turn", "continue_final_message")
        if not conversation or conversation[-1].get("role") != "assistant":
            raise ChatTemplateError("continue_final_message needs an assistant message last", "continue_final_message")
    clash = sorted(set(template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {clash}: they are options of their own",
                                "chat_template_kwargs")
    extra = dict(template_kwargs or {})
    if template is not None:
        extra["chat_template"] = template
    if tools:
        if not template_takes_tools(tokenizer, template):
            raise ChatTemplateError("this chat template does not take tools (the server writes them into the "
                                    "conversation instead: docs/serving.md)", "tools")
        extra["tools"] = tools
    if continue_final_message:
        extra["continue_final_message"] = True
    conversation = _with_text_content(conversation)
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
        raise ChatTemplateError(f"the chat template rejected the messages: {e}", "messages") from None
