# round 44 call B: main as it stands: 1 stream in-process vs remote (socket)
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 32 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 170 python3 bench/serving.py $A --configs ngram,remote-ngram-socket --concurrency 1 --json $OUT/s44c1.json --repeat 1 > $OUT/s44c1.log 2>&1
echo rc=$?; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s44c1.log | tail -2 | cut -d'|' -f2-9
grep -A6 "^## Side by side" $OUT/s44c1.log | tail -4
gzip -f $OUT/*.json 2>/dev/null
