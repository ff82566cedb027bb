# round 50 call 5 (model staged): bf16, 32 streams, 3 pairs, host vs device n-gram; then the full GPU suite on SmolLM2
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 ${C32_S:-330} python3 bench/serving.py $A --pairs 3 --min-prompts 128 --configs ngram,ngram-device --concurrency 32 --interleave --json $OUT/s50c32.json --repeat 1 > $OUT/s50c32.log 2>&1
echo "c32 rc=$?"; grep -A4 "^| server | c | pairs | on tok/s" $OUT/s50c32.log | tail -3 | cut -d'|' -f2-9
timeout -k 5 ${T_S:-240} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py > $OUT/gpu_suite.txt 2>&1; echo "suite rc=$?" >> $OUT/gpu_suite.txt
tail -4 $OUT/gpu_suite.txt
gzip -f $OUT/*.json 2>/dev/null
