# round 51 (model staged): the pipelined GPU tests on SmolLM2 (fp32 static/adaptive, bf16 exact), then bf16 8 streams, 3 pairs, 3 configs interleaved
source .devrun/join.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "pipelined" > $OUT/gpu_pipe_smollm2.txt 2>&1; echo "rc=$?" >> $OUT/gpu_pipe_smollm2.txt; grep -E "identical|passed|failed|rc=" $OUT/gpu_pipe_smollm2.txt
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 ${C8_S:-300} python3 bench/serving.py $A --pairs 3 --min-prompts 64 --configs ngram,ngram-device,ngram-pipe --concurrency 8 --interleave --json $OUT/s51c8b.json --repeat 1 > $OUT/s51c8b.log 2>&1
echo "c8 rc=$?"; grep -A5 "^| server | c | pairs | on tok/s" $OUT/s51c8b.log | tail -4 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
