"""Two checkouts side by side: plain and n-gram decoding on the default model at batch 1 and 16,
or (``--forwards``) one model forward over 1..N rows, a decode step or a verification.

Each round runs every checkout in its own process (``PYTHONPATH`` pointing at it), the order
alternating round by round; reported: the median tok/s (or ms) per configuration and the ratio.

    git worktree add /tmp/before REV
    python benchmarks/before_after.py 6 --before /tmp/before --after .
    python benchmarks/before_after.py 4 --before /tmp/before --forwards 1,5,8,16,64 \
        --model qwen2.5-coder-1.5b-instruct
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
CODE = r'''
import json, sys, time, torch
torch.set_num_threads(2)
from specserve import LLM, SamplingParams
prompts = [f"Write a short story about a {w} who learns to code." for w in
           ["cat", "dog", "robot", "pirate", "wizard", "farmer", "sailor", "child", "doctor", "baker", "king", "fox",
            "owl", "miner", "poet", "chef"]]
res = {}
for name, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
    llm = LLM(speculative_config=spec, max_model_len=1024, kv_cache_memory=1 << 28)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for batch in (1, 16):
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        t = time.perf_counter(); n = 0
        group = prompts[:4] if batch == 1 else prompts
        if batch == 1:
            for p in group:
                n += len(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
        else:
            n += sum(len(o.outputs[0].token_ids) for o in llm.generate(group, params, use_tqdm=False))
        res[f"{name} b{batch}"] = n / (time.perf_counter() - t)
print(json.dumps(res))
'''
FORWARDS = r'''
import json, sys, torch
torch.set_num_threads(2)
from specserve import LLM
from benchmarks.forward_timing import time_forwards
llm = LLM(model=None if sys.argv[1] == "default" else sys.argv[1], max_model_len=1024, kv_cache_memory=1 << 28)
rows = [int(r) for r in sys.argv[2].split(",")]
medians = time_forwards({"x": llm}, rows, rounds=2)
print(json.dumps({f"forward {r} rows ms": medians["x", r] for r in rows}))
'''
ap = argparse.ArgumentParser()
ap.add_argument("rounds", type=int, nargs="?", default=3)
ap.add_argument("--before", required=True)
ap.add_argument("--after", default=".")
ap.add_argument("--forwards", help="comma list of row counts: time model forwards instead of decoding")
ap.add_argument("--model", default="default", help="with --forwards: the model to load")
args = ap.parse_args()
command = ["-c", FORWARDS, args.model, args.forwards] if args.forwards else ["-c", CODE]
trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
out = {k: [] for k in trees}
for r in range(args.rounds):
    for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
        env = dict(os.environ, PYTHONPATH=trees[name])
        p = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, cwd=trees[name])
        line = [l for l in p.stdout.splitlines() if l.startswith("{")]
        if not line:
            print(name, p.stderr[-800:]); continue
        out[name].append(json.loads(line[-1]))
        print(name, out[name][-1], flush=True)
keys = list(out["after"][0])
unit = "ms" if args.forwards else "tok/s"
print(f"| configuration | before {unit} | after {unit} | after / before |")
print("|---|---|---|---|")
for k in keys:
    b = statistics.median(x[k] for x in out["before"]); a = statistics.median(x[k] for x in out["after"])
    print(f"| {k} | {b:.1f} | {a:.1f} | {a / b:.2f}x |")
