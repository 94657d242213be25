"""specserve as a bench engine: one ``LLM`` per configuration, answering a group of prompts at a time.

A bench engine has a ``name``, ``tokenizer()``, ``run(prompts, max_tokens, temperature,
seeds, ignore_eos) -> GroupResult`` and ``close()``; ``SpecserveEngine`` is
specserve's, ``peers.py`` holds the peers' (transformers, llama.cpp).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from specserve.bench.options import BenchOptions, BenchPrompt, Config


@dataclass
class GroupResult:
    token_ids: list[list[int]]
    spec_stats: list[object | None]           # SpecDecodeStats per request (specserve only)
    decode_seconds: float | None = None       # last finish - last first token (specserve only)


class SpecserveEngine:
    def __init__(self, config: Config, opts: BenchOptions):
        from specserve import LLM

        self.name = config.name
        self.llm = LLM(
            model=opts.model,
            dtype=opts.dtype,
            device=opts.device,
            max_model_len=opts.max_model_len,
            kv_cache_memory=opts.kv_cache_memory,
            int8_activations=opts.int8_activations,
            seed=opts.seed,
            speculative_config=config.speculative_config,
            max_num_seqs=max(64, max(opts.batch_sizes)),
            # Off for every configuration: cycled prompts and warm-ups would otherwise
            # skip prefill in the runs after the first, so the order of runs would count.
            enable_prefix_caching=False,
        )
        spec = self.llm.engine.spec_config if hasattr(self.llm.engine, "spec_config") else None
        self.resolved = _spec_as_dict(spec)

    def tokenizer(self):
        return self.llm.get_tokenizer()

    def run(self, prompts: list[BenchPrompt], max_tokens: int, temperature: float, seeds: list[int],
            ignore_eos: bool) -> GroupResult:
        from specserve import SamplingParams

        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                 seed=None if temperature == 0 else s,
                                 stop_token_ids=list(p.stop_token_ids) if not ignore_eos else [])
                  for s, p in zip(seeds, prompts)]
        outs = self.llm.generate([p.token_ids for p in prompts], params, use_tqdm=False)
        first = [o.metrics.get("first_token_time") for o in outs]
        finish = [o.metrics.get("finish_time") for o in outs]
        decode = max(finish) - max(first) if None not in first and None not in finish else None
        return GroupResult([list(o.outputs[0].token_ids) for o in outs], [o.spec_decode_stats for o in outs], decode)

    def close(self) -> None:
        pass


def _spec_as_dict(spec) -> dict | None:
    if spec is None:
        return None
    try:
        import dataclasses

        d = dataclasses.asdict(spec)
    except TypeError:
        return None
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if isinstance(d.get("model"), str) and d["model"].startswith(pkg + os.sep):   # a shipped draft
        d["model"] = "specserve/" + os.path.relpath(d["model"], pkg)
    return {k: v for k, v in d.items() if v is not None and not callable(v)}
