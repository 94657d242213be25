"""Self-distillation data: the target's own generations and hidden states.

The target answers the training prompts with specserve's batched engine
(greedy and sampled), and a recording proposer (``FeatureRecorder``: it drafts
nothing, it only ``observe``s) keeps the target's final hidden state at every
computed position. Those hidden states are all a draft needs from the target:

- an EAGLE head's input features and regression targets;
- the target's next-token distribution at any position, exactly, as
  ``softmax(hidden @ lm_head.T)`` (over a draft vocabulary if wanted), so no
  top-k logits need to be stored.

A dataset is a folder of shards (``shard-00000.pt``...), each a list of
records ``{"tokens": int32 [L], "prompt_len": int, "features": bf16 [L-1, H],
"temperature": float}``; ``features[t]`` is the hidden state at position t (the
last token is sampled but never fed back, so it has none). Shards are written
as they finish, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch
from tqdm.auto import tqdm

from specserve.core.scheduler import ScheduledRequest
from specserve.spec_decode.proposer import Proposal, Proposer, TargetHidden

logger = logging.getLogger(__name__)

META_FILE = "meta.json"


class FeatureRecorder(Proposer):
    """A proposer that drafts nothing and records the target's hidden states per request.

    Pass it as ``LLM(..., proposer=recorder)``: with no speculative config it gets no
    lookahead slots and never drafts; the engine shows it the target's hidden states.
    """

    needs_target_hidden = True

    def __init__(self, dtype: torch.dtype = torch.bfloat16, feature_layers: tuple[int, ...] = ()):
        self.dtype = dtype
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        # also the residual stream before these target layers (an EAGLE-3 head's features), after the
        # final hidden state in each row: the engine sets them on the target (llm_engine.py)
        self.target_feature_layers = tuple(feature_layers)

    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        return Proposal(token_ids=[[] for _ in scheduled], probs=[None] * len(scheduled))

    def observe(self, states: list[TargetHidden]) -> None:
        for st in states:
            rows = st.hidden.to(device="cpu", dtype=self.dtype, copy=True)
            self.chunks.setdefault(st.request.request_id, []).append((st.start_position, rows))

    def pop(self, request_id: str) -> torch.Tensor:
        """[num_computed, H] hidden states of a finished request, in position order."""
        chunks = self.chunks.pop(request_id)
        rows, expected = [], 0
        for start, t in chunks:
            if start < expected:  # recomputed after preemption: drop what it replaces
                rows = _truncate(rows, start)
                expected = start
            assert start == expected, f"hidden states of request {request_id} have a gap at {expected}"
            rows.append(t)
            expected += t.shape[0]
        return torch.cat(rows)


def _truncate(rows: list[torch.Tensor], length: int) -> list[torch.Tensor]:
    out, n = [], 0
    for t in rows:
        if n >= length:
            break
        out.append(t[: length - n])
        n += out[-1].shape[0]
    return out


def format_prompt(tokenizer, text: str) -> list[int]:
    """The chat template when the tokenizer has one, else a plain 'User: / Assistant:' frame."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    else:
        rendered = f"User: {text}\nAssistant:"
    return tokenizer.encode(rendered, add_special_tokens=False)


def shard_path(data_dir: str, index: int) -> str:
    return os.path.join(data_dir, f"shard-{index:05d}.pt")


def generate_dataset(
    target: str | None,
    prompts: list[dict],
    data_dir: str,
    max_tokens: int = 192,
    temperatures: tuple[float, ...] = (0.0, 0.8),
    batch_size: int = 64,
    dtype: str = "float32",
    device: str | None = None,
    seed: int = 0,
    max_minutes: float | None = None,
    max_model_len: int | None = None,
    kv_cache_memory: int | None = None,
    feature_layers: tuple[int, ...] = (),
) -> dict:
    """Generate (or resume generating) the dataset; returns its meta (also saved as meta.json).

    One shard per ``batch_size`` prompts; each prompt is answered once per temperature.
    ``feature_layers``: each row also holds the residual stream before these target layers
    (after the final hidden state: [H * (1 + len)], an EAGLE-3 head's training data).
    """
    from specserve import LLM, SamplingParams

    os.makedirs(data_dir, exist_ok=True)
    num_shards = -(-len(prompts) // batch_size)
    todo = [i for i in range(num_shards) if not os.path.isfile(shard_path(data_dir, i))]
    meta_path = os.path.join(data_dir, META_FILE)
    if os.path.isfile(meta_path):       # data from a run before, whole or stopped early: the same rows?
        with open(meta_path) as f:
            meta = json.load(f)
        if tuple(meta.get("feature_layers", ())) != tuple(feature_layers):
            raise ValueError(f"the data in {data_dir} holds the features of layers {meta.get('feature_layers', [])}, "
                             f"not {list(feature_layers)}: use another --data-dir")
        if not todo:
            return meta
    if kv_cache_memory is None:  # room for the whole batch at full length (no preemption), +25%
        from specserve.model_executor.layers.fp16_gemm import compute_dtype_for
        from specserve.model_executor.loader import load_model, resolve_dtype

        cfg = load_model(target, torch.float32, load_weights=False).config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim
        kv_dtype = compute_dtype_for(resolve_dtype(dtype, torch.device(device)), device)  # the KV cache's dtype
        per_token *= torch.finfo(kv_dtype).bits // 8
        longest = max(len(p["prompt"]) for p in prompts) // 2 + 64 + max_tokens  # generous tokens per prompt
        kv_cache_memory = max(16 << 20, int(1.25 * per_token * longest * batch_size * len(temperatures)))
    recorder = FeatureRecorder(feature_layers=feature_layers)
    llm = LLM(
        model=target,
        dtype=dtype,
        device=device,
        seed=seed,
        max_model_len=max_model_len,
        kv_cache_memory=kv_cache_memory,
        max_num_seqs=batch_size * len(temperatures),
        max_num_batched_tokens=max(4096, 8 * batch_size),
        proposer=recorder,
        # The recorder needs the target's hidden state at every position; a cached prefix has none.
        enable_prefix_caching=False,
    )
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    meta = {
        "target": engine.model_name,
        "target_ref": target,
        "hidden_size": engine.hf_config.hidden_size,
        "vocab_size": engine.vocab_size,
        "max_tokens": max_tokens,
        "temperatures": list(temperatures),
        "num_prompts": len(prompts),
        "batch_size": batch_size,
        "dtype": dtype,
        "feature_layers": list(feature_layers),
    }
    started = time.monotonic()
    bar = tqdm(total=num_shards, initial=num_shards - len(todo), desc="Generating training data", unit="shard")
    stopped_early = False
    for index in todo:
        if max_minutes is not None and time.monotonic() - started > max_minutes * 60:
            stopped_early = True
            logger.warning("generation stopped after %.1f minutes (--max-gen-minutes); rerun to resume", max_minutes)
            break
        batch = prompts[index * batch_size : (index + 1) * batch_size]
        token_ids = [format_prompt(tokenizer, p["prompt"]) for p in batch]
        requests = []
        for t in temperatures:
            for j, ids in enumerate(token_ids):
                params = SamplingParams(temperature=t, max_tokens=max_tokens, seed=seed * 1_000_003 + index * 1000 + j)
                requests.append((ids, params, t))
        outs = llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
        records = []
        for (ids, _, t), out in zip(requests, outs):
            features = recorder.pop(out.request_id)
            tokens = list(ids) + list(out.outputs[0].token_ids)
            assert features.shape[0] == len(tokens) - 1, (features.shape, len(tokens))
            records.append({
                "tokens": torch.tensor(tokens, dtype=torch.int32),
                "prompt_len": len(ids),
                "features": features,
                "temperature": t,
            })
        tmp = shard_path(data_dir, index) + ".tmp"
        torch.save(records, tmp)
        os.replace(tmp, shard_path(data_dir, index))
        bar.update(1)
        bar.set_postfix(tokens=sum(len(r["tokens"]) - r["prompt_len"] for r in records))
    bar.close()
    meta["complete"] = not stopped_early
    meta["generation_minutes_this_run"] = round((time.monotonic() - started) / 60, 2)
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def load_dataset(data_dir: str) -> list[dict]:
    """Every record of every finished shard, in shard order."""
    names = sorted(n for n in os.listdir(data_dir) if n.startswith("shard-") and n.endswith(".pt"))
    if not names:
        raise ValueError(f"no training data in {data_dir} (generate it first)")
    records = []
    for n in names:
        records.extend(torch.load(os.path.join(data_dir, n), weights_only=True))
    return records


def response_token_counts(records: list[dict], vocab_size: int) -> torch.Tensor:
    """[V] how often the target emitted each token (responses only)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        counts += torch.bincount(r["tokens"][r["prompt_len"] :].long(), minlength=vocab_size)[:vocab_size]
    return counts


def choose_draft_vocab(records: list[dict], vocab_size: int, size: int | None) -> tuple[torch.Tensor | None, float]:
    """The ``size`` most frequent response tokens (sorted ids) and the share of tokens they cover.

    Ties, including every token never seen, are broken in favour of lower token ids.

    ``None`` (size 0/None or >= vocab): the whole vocabulary.
    """
    if not size or size >= vocab_size:
        return None, 1.0
    counts = response_token_counts(records, vocab_size)
    # Ties (above all: tokens never seen) go to lower ids: BPE merges come in corpus-frequency order.
    prior = 0.5 * (1 - torch.arange(vocab_size, dtype=torch.float64) / vocab_size)
    top = (counts.double() + prior).topk(size).indices
    coverage = counts[top].sum().item() / max(1, counts.sum().item())
    return top.sort().values, coverage
