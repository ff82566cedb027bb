#!/usr/bin/env bash
# The round's GPU figures in one device call (needs the SmolLM2 GGUF where the loader finds
# it): GPU tests, kernel micro-benchmarks, verify-step latency, and the serving benchmark in
# bf16, fp32 and bf16 --exact. Everything lands in $OUT/r/, packed as $OUT/results.tgz.
#   OUT=/dir [PART=kernels|serving] bash bench/gpu_final.sh
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
R="$OUT/r"
mkdir -p "$R"
run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  echo "=== $name ($(date +%T))"
  timeout --kill-after=5 "$limit" "$@" > "$R/$name.log" 2>&1
  echo "rc=$? $name $((SECONDS - t0))s" | tee -a "$OUT/summary.log"
}
serve() {  # serve NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  run "$name" "$limit" "$PY" bench/serving.py --model smollm2-135m --device cuda \
    --max-batch-size 64 --max-num-tokens 1024 --metrics --json "$R/$name.json" "$@"
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/summary.log"
if [ "${PART:-all}" != serving ]; then
run gpu_tests 150 "$PY" -m pytest -q -s -m gpu tests/test_gpu.py
run kernel_count 60 "$PY" bench/kernel_count.py --shape smollm2 --batch 1 --q 5
run kernel_count_llama 60 "$PY" bench/kernel_count.py --shape llama3-8b --batch 1 --q 5
run verify_step 90 "$PY" bench/verify_step.py --device cuda --shapes smollm2,llama3-8b \
  --batches 1,8,32 --ks 0,4 --ctx 1024 --iters 30 --out "$R"
run verify_step_exact 60 "$PY" bench/verify_step.py --device cuda --shapes smollm2,llama3-8b \
  --batches 1,32 --ks 0,4 --ctx 1024 --iters 20 --exact --tag _exact --out "$R"
fi
if [ "${PART:-all}" != kernels ]; then
serve serving_bf16 150 --configs none,ngram,remote-ngram --concurrency 1,8,32,64
serve serving_fp32 110 --dtype float32 --configs none,ngram --concurrency 1,8,32,64
serve serving_bf16_exact 110 --target-arg=--exact=on --configs none,ngram --concurrency 1,8,32,64
fi
tar czf "$OUT/results.tgz" -C "$OUT" r
for f in "$R"/*.log; do tail -45 "$f"; done > "$OUT/tails.log"
