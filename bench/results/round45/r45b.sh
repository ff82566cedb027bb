# round 45 call B: 32 streams in-process vs remote (socket), interleaved
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 128 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 320 python3 bench/serving.py $A --configs ngram,remote-ngram-socket --concurrency 32 --interleave --json $OUT/s45c32.json --repeat 1 > $OUT/s45c32.log 2>&1
echo "c32 rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s45c32.log | tail -2 | cut -d'|' -f2-9
grep -A6 "^## Side by side" $OUT/s45c32.log | tail -4
gzip -f $OUT/*.json 2>/dev/null
