# round 51 (model staged): bf16, 8 streams, 3 pairs interleaved: device n-gram synchronous vs pipelined
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 ${C8_S:-300} python3 bench/serving.py $A --pairs 3 --min-prompts 64 --configs ngram,ngram-device,ngram-pipe --concurrency 8 --interleave --json $OUT/s51c8.json --repeat 1 > $OUT/s51c8.log 2>&1
echo "c8 rc=$?"; grep -A5 "^| server | c | pairs | on tok/s" $OUT/s51c8.log | tail -4 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
