# prepared for the next GPU session (model staged: source .devrun/join.sh): where a GPU start goes (the engine's phase line; the first start on a fresh machine compiles Triton's kernels), then the 64-row host profile per thread (the sampler, biased toward calls that release the GIL: where each thread blocks; Python 3.12's cProfile counts every thread)
source .devrun/join.sh > /dev/null 2>&1
timeout -k 5 ${ST_S:-200} python3 bench/startup.py --device cuda --runs 3 > $OUT/startup.txt 2>&1; echo "startup rc=$?"; grep "^run\|^|" $OUT/startup.txt
E="python3 bench/engine_only.py --model smollm2-135m --device cuda --max-draft-len 8 --max-batch-size 64 --max-num-tokens 1024 --concurrency 64 --min-prompts 128 --pass-factor 1 --max-new-tokens 256 --profile-rows 40 --profile-mode sample"
timeout -k 5 ${P_S:-80} $E --drafter ngram --profile executor > $OUT/sample_exec_ngram.txt 2>&1; echo "rc=$?"; grep "engine-only\|sampled" $OUT/sample_exec_ngram.txt
timeout -k 5 ${P_S:-80} $E --drafter ngram --profile output > $OUT/sample_out_ngram.txt 2>&1; echo "rc=$?"; grep "engine-only\|sampled" $OUT/sample_out_ngram.txt
timeout -k 5 ${P_S:-80} $E --drafter none --profile executor > $OUT/sample_exec_none.txt 2>&1; echo "rc=$?"; grep "engine-only\|sampled" $OUT/sample_exec_none.txt
true
