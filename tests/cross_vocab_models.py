"""Tokenizers unlike the default model's, and tiny drafts with them, for drafting across
vocabularies (tests/spec_decode/test_cross_vocab*.py). Built in about a second with the
``tokenizers`` library, no download:

- ``sentencepiece_style``: Gemma's kind of vocabulary (a BPE with '▁' for the space,
  ``<0xNN>`` byte-fallback pieces, a BOS put before every text), trained without
  pre-tokenization so its pieces cross word boundaries ('e▁t': one draft token over two
  of the default model's), and so small that most of the default model's tokens are two
  or more of its pieces;
- ``disjoint``: a word-level vocabulary that spells none of the default model's tokens;
- ``write_mimic_draft``: a draft that computes its target's logits through another
  vocabulary (below).
"""
from __future__ import annotations

import json

CORPUS = [
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
    "experimented with two-wheeled machines pushed along by the rider's feet.",
    "Over the following decades pedals, chains, pneumatic tyres and lighter frames turned the "
    "curiosity into one of the most efficient means of transport ever devised.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.",
    "List the numbers from 1 to 10, separated by commas: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
    "Café, naïve, résumé, déjà vu — 你好，世界! Привет мир. 🙂 emoji and ünïcödé.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
]


def sentencepiece_style(vocab_size: int = 500):
    """A Gemma-like tokenizer (module docstring) as a transformers ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                             show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):                       # byte-fallback pieces: ordinary vocabulary entries, as in Gemma
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")


def disjoint(num_words: int = 64):
    """Words 'qzxv0' ... that are no token of the default model's vocabulary, nor any of its pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{f"qzxv{i}": 2 + i for i in range(num_words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<eos>", "<unk>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


SHADOW = "Ā"   # the byte-level stand-in of byte 0x00: a shadow token's string is this + its original's


def mimic_vocabulary(tokenizer, keep_every: int = 2):
    """The default model's byte-level BPE changed three ways: of the tokens no merge builds on
    (whole words, mostly) every ``keep_every``-th kept and the others dropped with the merge that
    makes them (the draft spells those words in two tokens where the target has one), the kept
    tokens numbered in reverse, and a *shadow* for each kept token: its string with a 0x00 byte in
    front, a token no merge makes and the target's vocabulary lacks. -> (a transformers tokenizer,
    source): ``source[d]`` is the target id whose embedding draft id d takes (its own string's
    for a kept token, its original's for a shadow)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    specials = {a["content"] for a in spec["added_tokens"]}
    built_on = {part for merge in spec["model"]["merges"] for part in merge}
    ordinary = sorted((i, t) for t, i in vocab.items() if t not in specials)
    leaves = [i for i, t in ordinary if t not in built_on and len(t) > 1]
    dropped = {i for n, i in enumerate(leaves) if n % keep_every}
    kept = [(i, t) for i, t in ordinary if i not in dropped]
    first = len(specials)
    new_vocab = {t: i for t, i in vocab.items() if t in specials}
    source = [vocab[t] for t in sorted(new_vocab, key=new_vocab.get)]
    for i, t in reversed(kept):
        new_vocab[t] = first + len(source) - len(specials)
        source.append(i)
    for i, t in reversed(kept):
        new_vocab[SHADOW + t] = len(source)
        source.append(i)
    spec["model"]["vocab"] = new_vocab
    spec["model"]["merges"] = [m for m in spec["model"]["merges"]
                               if m[0] in new_vocab and m[1] in new_vocab and m[0] + m[1] in new_vocab]
    for a in spec["added_tokens"]:
        a["id"] = new_vocab[a["content"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=tokenizer.bos_token,
                                      eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token)
    return wrapped, source


def write_mimic_draft(folder: str, target_folder: str, keep_every: int = 2) -> str:
    """A draft that is its target (a tiny Llama of ``tests/tiny_models.py`` with tied embeddings)
    read through ``mimic_vocabulary``: the same layers, and each draft token's embedding row that
    of its source target token. Reading the same tokens it computes the target's logits at every
    kept token, and the same logit again at each one's shadow: its distribution is the target's
    on the tokens the two vocabularies share, renormalized, with as much mass again on tokens the
    target lacks. A strong draft for greedy acceptance, and a sharp test of a verifier that
    forgets to renormalize to the shared tokens (it would accept twice too often)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(target_folder, torch_dtype=torch.float32)
    tokenizer, source = mimic_vocabulary(AutoTokenizer.from_pretrained(target_folder), keep_every)
    config = LlamaConfig.from_pretrained(target_folder)
    config.vocab_size = len(source)
    draft = LlamaForCausalLM(config)
    state = target.state_dict()
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][torch.tensor(source)]
    state.pop("lm_head.weight", None)
    draft.load_state_dict(state, strict=False)
    draft.tie_weights()
    draft.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
