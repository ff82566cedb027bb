# round 56 (model staged): the remote n-gram drafter against the in-process host lookup and the default at 8 streams, with passes twice as long and three pairs (round 55 had two pairs of ~1 s passes), bf16, interleaved
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4 --configs ngram,ngram-host,remote-ngram-socket,remote-ngram-socket-pipe --interleave --repeat 1"
timeout -k 5 ${C8_S:-420} python3 bench/serving.py $A --pairs ${PAIRS:-3} --min-prompts 128 --concurrency 8 --json $OUT/s56c8.json > $OUT/s56c8.log 2>&1; echo "c8 rc=$?"; grep -A6 "^| server | c | pairs | on tok/s" $OUT/s56c8.log | tail -5 | cut -d'|' -f2-9
grep "c=8 on\|c=8 off" $OUT/s56c8.log | cut -c1-160
gzip -f $OUT/*.json 2>/dev/null; true
