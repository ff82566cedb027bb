# round 50 call 4 (model staged): bf16, 8 streams, interleaved, 3 pairs: in-process n-gram on the host, on the device (no-match rule), remote n-gram on the socket
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/smi4.txt; git log --oneline -1 >> $OUT/smi4.txt
timeout -k 5 ${C8_S:-560} python3 bench/serving.py $A --pairs 3 --min-prompts 128 --configs ngram,ngram-device,remote-ngram-socket --concurrency 8 --interleave --json $OUT/s50c8.json --repeat 1 > $OUT/s50c8.log 2>&1
echo "c8 rc=$?"; grep -A5 "^| server | c | pairs | on tok/s" $OUT/s50c8.log | tail -4 | cut -d'|' -f2-9
grep -A7 "^## Side by side" $OUT/s50c8.log | tail -5
gzip -f $OUT/*.json 2>/dev/null
