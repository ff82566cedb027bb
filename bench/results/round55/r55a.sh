# round 55 (model staged): the three runner-level GPU tests that failed on the CUDA default (fixed in 880db16/ec1f04b), then the host's time at 64 rows (engine without gRPC, bf16, graphs): cProfile of the executor with the default n-gram and with no drafter
source .devrun/join.sh > /dev/null 2>&1
timeout ${T_S:-150} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "mixed_steps or fused_ops" > $OUT/gpu_fixed.txt 2>&1; echo "rc=$?" >> $OUT/gpu_fixed.txt; tail -3 $OUT/gpu_fixed.txt
E="python3 bench/engine_only.py --model smollm2-135m --device cuda --max-draft-len 8 --max-batch-size 64 --max-num-tokens 1024 --concurrency 64 --min-prompts 128 --pass-factor 1 --max-new-tokens 256 --profile-rows 45"
timeout -k 5 ${P_S:-80} $E --drafter ngram --profile executor > $OUT/prof_exec_ngram.txt 2>&1; echo "rc=$?"; grep "engine-only" $OUT/prof_exec_ngram.txt
timeout -k 5 ${P_S:-80} $E --drafter none --profile executor > $OUT/prof_exec_none.txt 2>&1; echo "rc=$?"; grep "engine-only" $OUT/prof_exec_none.txt
[ "${OUT_PROF:-1}" != 0 ] && { timeout -k 5 ${P_S:-80} $E --drafter ngram --profile output > $OUT/prof_out_ngram.txt 2>&1; echo "rc=$?"; grep "engine-only" $OUT/prof_out_ngram.txt; }
true
