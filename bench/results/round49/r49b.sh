# round 49 call 4 (H200 wanted): bf16, in-process n-gram on the host vs on the device (--draft-on-device), interleaved, 8 then 32 streams
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/smi4.txt; git log --oneline -1 >> $OUT/smi4.txt
timeout -k 5 250 python3 bench/serving.py $A --pairs 2 --min-prompts 128 --configs ngram,ngram-device --concurrency 8 --interleave --json $OUT/s49c8.json --repeat 1 > $OUT/s49c8.log 2>&1
echo "c8 rc=$?"; grep -A4 "^| server | c | pairs | on tok/s" $OUT/s49c8.log | tail -3 | cut -d'|' -f2-9
timeout -k 5 250 python3 bench/serving.py $A --pairs 2 --min-prompts 128 --configs ngram,ngram-device --concurrency 32 --interleave --json $OUT/s49c32.json --repeat 1 > $OUT/s49c32.log 2>&1
echo "c32 rc=$?"; grep -A4 "^| server | c | pairs | on tok/s" $OUT/s49c32.log | tail -3 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
