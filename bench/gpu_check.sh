#!/usr/bin/env bash
# One device call: GPU tests and micro-benchmarks on random or tiny weights (no model files).
#   OUT=/dir bash bench/gpu_check.sh
# Logs land in $OUT (each step has its own timeout; a failure does not stop the next).
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
log() { echo "=== $* ($(date +%T))"; }
run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  log "$name"
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? $name" | tee -a "$OUT/summary.log"
  tail -25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/summary.log"
run kernel_tests 150 "$PY" -m pytest -q tests/test_triton_attention.py
run gpu_tests 240 env SPECWIRE_GPU_TEST_MODEL="${GPU_TEST_MODEL:-tiny-random}" \
  "$PY" -m pytest -q -m gpu tests/test_gpu.py
run attention_bench 90 "$PY" bench/attention_kernel.py
run layer_ops 90 "$PY" bench/layer_ops.py
run ops_tests 150 "$PY" -m pytest -q tests/test_triton_ops.py
run verify_step 200 "$PY" bench/verify_step.py --device cuda --shapes smollm2,llama3-8b \
  --batches 1,8,32 --ks 0,4 --ctx 1024 --iters 30 --out "$OUT"
run verify_step_exact 150 "$PY" bench/verify_step.py --device cuda --shapes smollm2,llama3-8b \
  --batches 1,32 --ks 0,4 --ctx 1024 --iters 30 --exact --tag _exact --out "$OUT"
