# round 53 (model staged): fp32 serving with the new default n-gram drafter (device lookup, pipelined), paired with spec off, at 64 and 8 streams
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --dtype float32 --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 ${C64_S:-120} python3 bench/serving.py $A --pairs 2 --min-prompts 256 --configs ngram --concurrency 64 --json $OUT/s53f64.json --repeat 1 > $OUT/s53f64.log 2>&1
echo "c64 rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s53f64.log | tail -2 | cut -d'|' -f2-9
timeout -k 5 ${C8_S:-100} python3 bench/serving.py $A --pairs 2 --min-prompts 64 --configs ngram --concurrency 8 --json $OUT/s53f8.json --repeat 1 > $OUT/s53f8.log 2>&1
echo "c8 rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s53f8.log | tail -2 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
