# round 55 (model staged): fp32 serving with the CUDA default (device n-gram lookup, pipelined steps) against no drafter at 1 and 32 streams (8 and 64 ran in round 54)
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --dtype float32 --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4 --configs ngram --interleave --repeat 1"
timeout -k 5 ${C1_S:-200} python3 bench/serving.py $A --pairs 2 --min-prompts 16 --concurrency 1 --json $OUT/s55f1.json > $OUT/s55f1.log 2>&1; echo "c1 rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s55f1.log | tail -2 | cut -d'|' -f2-9
timeout -k 5 ${C32_S:-200} python3 bench/serving.py $A --pairs 2 --min-prompts 128 --concurrency 32 --json $OUT/s55f32.json > $OUT/s55f32.log 2>&1; echo "c32 rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s55f32.log | tail -2 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null; true
