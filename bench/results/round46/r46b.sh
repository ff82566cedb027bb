# round 46 call B: 8 streams interleaved with the phase timer on both servers; fp32 in-process n-gram on / off at 32 and 64 streams
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 128 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
mkdir -p /tmp/ph8
PHASES_EXTRA="$(cat .devrun/extra.txt)" PHASES_DIR=/tmp/ph8 PYTHONPATH=$PWD/bench/phase_timer:$PYTHONPATH timeout -k 5 180 python3 bench/serving.py $A --configs ngram,remote-ngram-socket --concurrency 8 --interleave --json $OUT/s46c8p.json --repeat 1 > $OUT/s46c8p.log 2>&1
echo "c8 rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s46c8p.log | tail -2 | cut -d'|' -f2-9
grep -A6 "^## Side by side" $OUT/s46c8p.log | tail -4
(cd /tmp && tar czf $OUT/ph8.tgz ph8)
timeout -k 5 ${FP32_S:-200} python3 bench/serving.py $A --dtype float32 --configs ngram --concurrency 32,64 --json $OUT/f46c32_64.json --repeat 1 > $OUT/f46c32_64.log 2>&1
echo "fp32 rc=$?"; grep -A4 "^| server | c | pairs | on tok/s" $OUT/f46c32_64.log | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
