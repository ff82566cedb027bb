# round 50, fresh machine last call (model staged): bf16, 32 streams, host vs device n-gram after 48be734, 3 pairs
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/smi_f.txt
timeout -k 5 ${C32_S:-300} python3 bench/serving.py $A --pairs 3 --min-prompts 128 --configs ngram,ngram-device --concurrency 32 --interleave --json $OUT/s50c32b.json --repeat 1 > $OUT/s50c32b.log 2>&1
echo "c32 rc=$?"; grep -A4 "^| server | c | pairs | on tok/s" $OUT/s50c32b.log | tail -3 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
