# round 43: 32 streams, in-process vs remote (socket), this tree
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 128 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 135 python3 bench/serving.py $A --json $OUT/s43c32r.json --configs ngram,remote-ngram-socket --concurrency 32 --repeat 1 > $OUT/s43c32r.log 2>&1
echo rc=$?; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s43c32r.log | tail -2 | cut -d'|' -f2-9
grep -A6 "^## Side by side" $OUT/s43c32r.log
gzip -f $OUT/*.json 2>/dev/null
