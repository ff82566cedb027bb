# round 53 (model staged): bf16 serving at 32 streams interleaved, in-process pipelined vs remote socket sync/pipelined
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 ${C32_S:-300} python3 bench/serving.py $A --pairs ${C32_P:-1} --min-prompts 128 --configs ngram-pipe,remote-ngram-socket,remote-ngram-socket-pipe --concurrency 32 --interleave --json $OUT/s53c32.json --repeat 1 > $OUT/s53c32.log 2>&1
echo "c32 rc=$?"; grep -A6 "^| server | c | pairs | on tok/s" $OUT/s53c32.log | tail -5 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
