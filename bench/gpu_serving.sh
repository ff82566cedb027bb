#!/usr/bin/env bash
# One device call with the real SmolLM2 GGUF in place: GPU tests on it, then the serving bench.
#   OUT=/dir [SERVING_ARGS="..."] [SKIP_TESTS=1] bash bench/gpu_serving.sh
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? $name" | tee -a "$OUT/summary.log"
  tail -40 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/summary.log"
[ -n "$SKIP_TESTS" ] || run gpu_tests_smollm2 "${TESTS_LIMIT:-200}" "$PY" -m pytest -q -m gpu \
  tests/test_gpu.py
run serving "${SERVING_LIMIT:-330}" "$PY" bench/serving.py --model smollm2-135m --device cuda \
  --max-batch-size 64 --max-num-tokens 1024 --metrics --json "$OUT/serving.json" ${SERVING_ARGS:-}
