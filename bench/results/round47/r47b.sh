# round 47: bf16 in-process n-gram at 64 streams with passes twice as long (--min-prompts 256)
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 256 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/smi.txt; git log --oneline -1 >> $OUT/smi.txt; nproc >> $OUT/smi.txt
timeout -k 5 ${T:-230} python3 bench/serving.py $A --configs ngram --concurrency 64 --json $OUT/s47c64.json --repeat 1 > $OUT/s47c64.log 2>&1
echo "rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s47c64.log | tail -2 | cut -d'|' -f2-9
grep -i "steady" $OUT/s47c64.log | head -5
gzip -f $OUT/*.json 2>/dev/null
