# round 54 (model staged): the three runner-level GPU tests that failed on the CUDA default (fixed in 880db16), then the pipelined remote drafter at 1 and 8 streams with its hypothesis counters
source .devrun/join.sh > /dev/null 2>&1
timeout ${T_S:-150} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "mixed_steps or fused_ops" > $OUT/gpu_fixed.txt 2>&1; echo "rc=$?" >> $OUT/gpu_fixed.txt; tail -4 $OUT/gpu_fixed.txt
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
[ "${C8_S:-150}" != 0 ] && timeout -k 5 ${C8_S:-150} python3 bench/serving.py $A --pairs 2 --min-prompts 64 --configs ngram,remote-ngram-socket-pipe --concurrency 8 --interleave --json $OUT/s54c8.json --repeat 1 > $OUT/s54c8.log 2>&1
echo "c8 rc=$?"; grep -A4 "^| server | c | pairs | on tok/s" $OUT/s54c8.log | tail -3 | cut -d'|' -f2-9; grep -A4 "hypotheses held" $OUT/s54c8.log | head -6
gzip -f $OUT/*.json 2>/dev/null
