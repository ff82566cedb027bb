# round 55 (model staged): the remote n-gram drafter against the in-process one with the same information (the host lookup, synchronous) and against the default (device lookup, pipelined), bf16, interleaved, at 1 and 8 streams
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4 --configs ngram,ngram-host,remote-ngram-socket,remote-ngram-socket-pipe --interleave --repeat 1"
timeout -k 5 ${C1_S:-260} python3 bench/serving.py $A --pairs 2 --min-prompts 16 --concurrency 1 --json $OUT/s55c1.json > $OUT/s55c1.log 2>&1; echo "c1 rc=$?"; grep -A6 "^| server | c | pairs | on tok/s" $OUT/s55c1.log | tail -5 | cut -d'|' -f2-9
timeout -k 5 ${C8_S:-300} python3 bench/serving.py $A --pairs 2 --min-prompts 64 --concurrency 8 --json $OUT/s55c8.json > $OUT/s55c8.log 2>&1; echo "c8 rc=$?"; grep -A6 "^| server | c | pairs | on tok/s" $OUT/s55c8.log | tail -5 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null; true
