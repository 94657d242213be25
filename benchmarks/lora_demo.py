"""A LoRA adapter for the default model, trained with PEFT, then served by specserve: what it changes,
that specserve's answers with it are transformers + PEFT's, and what speculation gives with it.

    python benchmarks/lora_demo.py --out /tmp/caps-lora          # about 10 minutes on 2 cores

1. Data: the default model's own greedy answers to 64 of the training prompts
   (specserve/training/prompts.jsonl), upper-cased: the adapter learns to answer in capitals.
2. PEFT: LoRA of rank 8 on every projection, trained on the answers' tokens, saved with
   ``save_pretrained`` (adapter_config.json + adapter_model.safetensors) in ``--out``.
3. Checks on 8 held-out prompts: specserve (float32) with the adapter against transformers + PEFT
   on the same dequantized weights, greedy, token for token; the share of capital letters with and
   without the adapter; then, on the GGUF blocks as users run them, plain against n-gram, the
   shipped draft model and the shipped EAGLE head, each with the adapter: equal tokens, acceptance,
   and tokens/s side by side (configurations interleaved per prompt).
Writes ``--results`` (JSON) with every figure. ``--gguf FILE`` also writes the adapter as llama.cpp's
LoRA file with llama.cpp's own converter (``--llama-cpp-src``: the peer build's source), for
``specserve bench lora --lora FILE`` (against ``llama-server --lora``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

from specserve import LLM, LoRARequest, SamplingParams
from specserve.model_executor.loader import default_model_path
from specserve.training.prompts import PROMPTS_FILE

TRAIN, HELD_OUT = 64, 8
DRAFTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "specserve", "drafts")


def chat_prompts(count: int, skip: int = 0) -> list[str]:
    with open(PROMPTS_FILE, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r["prompt"] for r in rows[skip : skip + count]]


def train(out: str, steps: int, seed: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = LLM(dtype="float32", max_model_len=512)
    tok = base.get_tokenizer()
    prompts = chat_prompts(TRAIN)
    answers = base.chat([[{"role": "user", "content": p}] for p in prompts],
                        SamplingParams(temperature=0, max_tokens=64))
    rows = []
    for p, a in zip(prompts, answers):
        prompt_ids = base.apply_chat_template([{"role": "user", "content": p}])
        answer_ids = tok.encode(a.outputs[0].text.upper(), add_special_tokens=False) + [tok.eos_token_id]
        rows.append((prompt_ids, answer_ids))
    del base
    folder, file = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    losses, started = [], time.perf_counter()
    model.train()
    for step in range(steps):
        batch = [rows[i] for i in torch.randint(0, len(rows), (4,), generator=gen).tolist()]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tok.eos_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, a) in enumerate(batch):
            seq = p + a
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(a)
            mask[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if step % 20 == 0:
            print(f"step {step}: loss {loss:.3f}", flush=True)
    model.save_pretrained(out)
    return {"steps": steps, "batch": 4, "first_loss": losses[0], "last_loss_mean_10": sum(losses[-10:]) / 10,
            "train_seconds": time.perf_counter() - started}


def peft_greedy(out: str, prompt_ids: list[list[int]], max_tokens: int, eos: int) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, file = os.path.split(default_model_path())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, gguf_file=file,
                                                                           dtype=torch.float32), out).eval()
    results = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
            results.append(seq[: seq.index(eos) + 1] if eos in seq else seq)
    return results


def capitals(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def check(out: str, max_tokens: int) -> dict:
    adapter = LoRARequest("caps", 1, out)
    prompts = [[{"role": "user", "content": p}] for p in chat_prompts(HELD_OUT, skip=TRAIN)]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    exact = LLM(dtype="float32", max_model_len=512, enable_lora=True)
    with_adapter = exact.chat(prompts, greedy, lora_request=adapter)
    without = exact.chat(prompts, greedy)
    eos = exact.get_tokenizer().eos_token_id
    reference = peft_greedy(out, [o.prompt_token_ids for o in with_adapter], max_tokens, eos)
    ours = [o.outputs[0].token_ids for o in with_adapter]
    result = {
        "peft_equal_prompts": sum(a == b for a, b in zip(ours, reference)),
        "prompts": len(prompts),
        "capitals_with_adapter": sum(capitals(o.outputs[0].text) for o in with_adapter) / len(prompts),
        "capitals_without": sum(capitals(o.outputs[0].text) for o in without) / len(prompts),
        "example": {"prompt": prompts[0][0]["content"], "base": without[0].outputs[0].text,
                    "adapter": with_adapter[0].outputs[0].text},
    }
    del exact
    configs = {
        "plain": None,
        "ngram:4": {"method": "ngram", "num_speculative_tokens": 4},
        "draft:4": {"method": "draft_model", "model": os.path.join(DRAFTS, "smollm2-135m-draft"),
                    "num_speculative_tokens": 4},
        "eagle:3": {"method": "eagle", "model": os.path.join(DRAFTS, "smollm2-135m-eagle"),
                    "num_speculative_tokens": 3},
    }
    engines = {name: LLM(max_model_len=512, enable_lora=True, speculative_config=cfg) for name, cfg in configs.items()}
    timings = {name: {"adapter": 0.0, "base": 0.0} for name in configs}
    tokens = {name: {} for name in configs}
    for p in prompts:                                  # interleaved: every configuration per prompt
        for name, llm in engines.items():
            for which, lora in (("adapter", adapter), ("base", None)):
                started = time.perf_counter()
                answer = llm.chat([p], greedy, lora_request=lora)[0]
                timings[name][which] += time.perf_counter() - started
                tokens[name].setdefault(which, []).append(answer.outputs[0].token_ids)
    speed = {}
    for name, llm in engines.items():
        stats = llm.get_spec_decode_stats()
        total = {w: sum(len(t) for t in tokens[name][w]) for w in ("adapter", "base")}
        speed[name] = {
            "equal_to_plain_with_adapter": tokens[name]["adapter"] == tokens["plain"]["adapter"],
            "equal_to_plain_base": tokens[name]["base"] == tokens["plain"]["base"],
            "tok_s_adapter": total["adapter"] / timings[name]["adapter"],
            "tok_s_base": total["base"] / timings[name]["base"],
            "acceptance_both": stats.acceptance_rate if name != "plain" else None,
        }
    for name in configs:
        speed[name]["vs_plain_with_adapter"] = speed[name]["tok_s_adapter"] / speed["plain"]["tok_s_adapter"]
    result["speed"] = speed
    result["batch_of_8"] = batch_of_8(out, prompts, greedy)
    return result


def batch_of_8(out: str, prompts: list, greedy) -> dict:
    """Throughput of 8 requests at once: all on the base model, all with the adapter, and each pair with
    another adapter id (4 adapters in every step; the same matrices under 4 ids), interleaved 3 times."""
    llm = LLM(max_model_len=512, enable_lora=True, max_loras=4, max_cpu_loras=4)
    batch = prompts[:8]
    setups = {"base": [None] * 8, "one adapter": [LoRARequest("caps", 1, out)] * 8,
              "four adapters": [LoRARequest(f"caps{i % 4}", 1 + i % 4, out) for i in range(8)]}
    seconds, tokens, outputs = dict.fromkeys(setups, 0.0), dict.fromkeys(setups, 0), {}
    llm.chat(batch, greedy, lora_request=setups["four adapters"])      # warm-up, every adapter loaded
    for _ in range(3):
        for name, loras in setups.items():
            started = time.perf_counter()
            outs = llm.chat(batch, greedy, lora_request=loras)
            seconds[name] += time.perf_counter() - started
            tokens[name] += sum(len(o.outputs[0].token_ids) for o in outs)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
    return {"tok_s": {name: tokens[name] / seconds[name] for name in setups},
            "four_adapters_equal_one": outputs["four adapters"] == outputs["one adapter"]}


def write_gguf(out: str, gguf_path: str, llama_cpp_src: str) -> None:
    """The adapter in ``out`` as llama.cpp's LoRA file, by llama.cpp's convert_lora_to_gguf.py (its
    ``--base``: the default model's config and tokenizer, saved from specserve's reading of the file)."""
    from specserve.model_executor.loader import load_model

    base = load_model(None, torch.float32, load_weights=False)
    with tempfile.TemporaryDirectory() as folder:
        base.config.save_pretrained(folder)
        base.tokenizer.save_pretrained(folder)
        env = {**os.environ, "PYTHONPATH": os.path.join(llama_cpp_src, "gguf-py")}
        done = subprocess.run([sys.executable, os.path.join(llama_cpp_src, "convert_lora_to_gguf.py"), "--base", folder,
                               "--outtype", "f32", "--outfile", gguf_path, out], env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"convert_lora_to_gguf.py failed:\n{done.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the adapter's folder (written)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--skip-training", action="store_true", help="check an adapter already in --out")
    ap.add_argument("--results", default=None, help="JSON file for the figures (default: print only)")
    ap.add_argument("--gguf", default=None, metavar="FILE", help="also write the adapter as llama.cpp's LoRA file")
    ap.add_argument("--llama-cpp-src", default=os.path.expanduser("~/.cache/specserve-peers/llama.cpp/src"),
                    help="llama.cpp's source (its convert_lora_to_gguf.py), for --gguf")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    result = {"command": "python benchmarks/lora_demo.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                     for k, v in vars(args).items()
                                                                     if v not in (None, False)),
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip()}
    if not args.skip_training:
        result["training"] = train(args.out, args.steps, args.seed)
    if args.gguf:
        write_gguf(args.out, args.gguf, args.llama_cpp_src)
    result.update(check(args.out, args.max_tokens))
    print(json.dumps(result, indent=1))
    if args.results:
        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        with open(args.results, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
