# round 51 (model staged): bf16, one stream, 2 pairs, 3 configs interleaved
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 ${C1_S:-250} python3 bench/serving.py $A --pairs 2 --min-prompts 16 --configs ngram,ngram-device,ngram-pipe --concurrency 1 --interleave --json $OUT/s51c1b.json --repeat 1 > $OUT/s51c1b.log 2>&1
echo "c1 rc=$?"; grep -A5 "^| server | c | pairs | on tok/s" $OUT/s51c1b.log | tail -4 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
timeout -k 5 ${C32_S:-200} python3 bench/serving.py $A --pairs 2 --min-prompts 128 --configs ngram,ngram-pipe --concurrency 32 --interleave --json $OUT/s51c32b.json --repeat 1 > $OUT/s51c32b.log 2>&1
echo "c32 rc=$?"; grep -A4 "^| server | c | pairs | on tok/s" $OUT/s51c32b.log | tail -3 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
