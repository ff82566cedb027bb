# round 46 call A: the wire work alone on the GPU host; bf16, in-process vs remote (socket) interleaved at 32 and 64 streams (product code of ebfc581; 3229e43 adds only bench/pump_cost.py)
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 128 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/smi.txt; git log --oneline -1 >> $OUT/smi.txt; nproc >> $OUT/smi.txt
timeout 60 python3 bench/pump_cost.py --iters 2000 > $OUT/pump_cost.txt 2>&1; cat $OUT/pump_cost.txt
for c in 32 64; do
  timeout -k 5 $([ $c = 32 ] && echo 280 || echo 230) python3 bench/serving.py $A --configs ngram,remote-ngram-socket --concurrency $c --interleave --json $OUT/s46c$c.json --repeat 1 > $OUT/s46c$c.log 2>&1
  echo "c$c rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s46c$c.log | tail -2 | cut -d'|' -f2-9
  grep -A6 "^## Side by side" $OUT/s46c$c.log | tail -4
done
gzip -f $OUT/*.json 2>/dev/null
