"""``specserve chat`` (``entrypoints/chat_repl.py``): each line a turn of one conversation, the
answers streamed as ``LLM.chat`` gives them with the conversation so far, /reset and /exit, a turn
that does not fit refused without losing the conversation. Tiny random model, greedy."""
from __future__ import annotations

import io

import pytest

from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)

    def answer(conversation):
        return llm.chat(conversation, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].text

    return answer


def chat(monkeypatch, capsys, model, lines, *flags):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["chat", "--model", model, "--dtype", "float32", "--max-tokens", "6", "--max-model-len", "256",
                 *flags]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def printed(*answers: str) -> str:
    return "".join(a + "\n" for a in answers)


def test_turns_carry_the_conversation_and_reset_forgets_it(tiny_llama_dir, reference, monkeypatch, capsys):
    out, _ = chat(monkeypatch, capsys, tiny_llama_dir, ["one", "two", "/reset", "three", "/exit", "four"],
                  "--system-prompt", "Be brief.")
    system = [{"role": "system", "content": "Be brief."}]
    first = reference(system + [{"role": "user", "content": "one"}])
    second = reference(system + [{"role": "user", "content": "one"}, {"role": "assistant", "content": first},
                                 {"role": "user", "content": "two"}])
    third = reference(system + [{"role": "user", "content": "three"}])
    assert out == printed(first, second, third)     # "four" came after /exit


def test_a_turn_that_does_not_fit_is_refused_and_the_conversation_goes_on(tiny_llama_dir, reference, monkeypatch,
                                                                          capsys):
    out, err = chat(monkeypatch, capsys, tiny_llama_dir, ["one", "word " * 300, "two"])
    assert "error:" in err and "/reset" in err
    first = reference([{"role": "user", "content": "one"}])
    second = reference([{"role": "user", "content": "one"}, {"role": "assistant", "content": first},
                        {"role": "user", "content": "two"}])
    assert out == printed(first, second)


def test_with_speculation_each_answer_has_its_line(tiny_llama_dir, reference, monkeypatch, capsys):
    out, err = chat(monkeypatch, capsys, tiny_llama_dir, ["one", "two"], "--speculative-method", "ngram")
    assert err.count("[speculation: ngram]") == 2
    assert out.startswith(printed(reference([{"role": "user", "content": "one"}])))
