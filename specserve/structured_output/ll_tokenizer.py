"""The model's tokenizer as llguidance sees it: every token's bytes, and which are special.

llguidance's own reader (``llguidance.hf.from_tokenizer``) takes every added token written
like ``<...>`` for a special token, which only a grammar's ``<name>`` syntax can match. Many
models add such tokens as plain text (``special: false``): Qwen2.5's ``<tool_call>``, the
``<think>`` and ``</think>`` of Qwen3 and of DeepSeek-R1's distillations. The model writes
them as one token each and the decoded text shows them; but to llguidance they would be
specials, so a grammar's text ``"<tool_call>"`` would tokenize to a token it then refuses, and
free text could never contain ``</think>`` written as the model writes it.

So where a tokenizer has such tokens, llguidance gets it as a ``TokenizerWrapper``: the same
bytes for every token, special only where the tokenizer says so (its added specials, and the
tokens it names: end of sequence, padding, ...), and the tokenizer's own
encoding for the text a grammar forces (so ``<tool_call>`` is forced as its one token).
Other tokenizers are used as llguidance reads them.
"""
from __future__ import annotations


class InvalidTokenizerError(ValueError):
    """A tokenizer llguidance cannot read (a slow, Python tokenizer)."""


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_id: int | None):
    """``tokenizer`` (a transformers fast tokenizer) -> llguidance's ``LLTokenizer`` (about 0.3 s
    for 49,152 tokens; more where the wrapper is needed)."""
    import llguidance
    import llguidance.hf

    try:
        ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
    except ValueError as e:
        raise InvalidTokenizerError(str(e)) from None
    added = getattr(tokenizer, "added_tokens_decoder", {})
    named = set(tokenizer.all_special_ids)      # eos, bos, pad, ...: special whatever their flag says
    text_tokens = [i for i, t in added.items()
                   if not t.special and i not in named and i < vocab_size and ll.is_special_token(i)]
    if not text_tokens:
        return ll
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokensAsText(tokenizer, ll, added, vocab_size)),
                                  n_vocab=vocab_size, eos_token=eos_token_id if eos_token_id is not None else ll.eos_token)


class _TokensAsText:
    """What ``llguidance.TokenizerWrapper`` reads: ``tokens`` (bytes by id), ``special_token_ids``,
    ``eos_token_id``, ``bos_token_id``, and calling it encodes text (without added specials)."""

    def __init__(self, tokenizer, ll, added: dict, vocab_size: int):
        self._tokenizer = tokenizer
        size = min(len(tokenizer), vocab_size)
        # a special's bytes are its name; the model's padding rows past the tokenizer have none
        self.tokens = [ll.decode_bytes([i]) for i in range(size)] + [b""] * (vocab_size - size)
        self.eos_token_id = ll.eos_token      # never None: the wrapper would add a token for it
        specials = {i for i, t in added.items() if t.special} | set(tokenizer.all_special_ids) | {self.eos_token_id}
        self.special_token_ids = sorted(i for i in specials if i < size)
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):   # TokenizerWrapper tries bytes first; text is what we take
            raise TypeError("text only")
        return self._tokenizer.encode(text, add_special_tokens=False)
