# round 55 (model staged): as r55c.sh at 32 streams (one pair)
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4 --configs ngram,ngram-host,remote-ngram-socket,remote-ngram-socket-pipe --interleave --repeat 1"
timeout -k 5 ${C32_S:-300} python3 bench/serving.py $A --pairs 1 --min-prompts 128 --concurrency 32 --json $OUT/s55c32.json > $OUT/s55c32.log 2>&1; echo "c32 rc=$?"; grep -A6 "^| server | c | pairs | on tok/s" $OUT/s55c32.log | tail -5 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null; true
