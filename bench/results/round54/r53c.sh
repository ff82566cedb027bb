# round 53 (model staged): the GPU suite with the new defaults (device lookup + pipelined steps on CUDA), then bf16 serving: default ngram vs the host lookup at 64 and 1 streams
source .devrun/join.sh > /dev/null 2>&1
timeout ${T_S:-270} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py > $OUT/gpu_suite.txt 2>&1; echo "suite rc=$?" >> $OUT/gpu_suite.txt; grep -E "identical|passed|failed|rc=|Error" $OUT/gpu_suite.txt | tail -30
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 ${C64_S:-150} python3 bench/serving.py $A --pairs 2 --min-prompts 256 --configs ngram,ngram-host --concurrency 64 --interleave --json $OUT/s53c64.json --repeat 1 > $OUT/s53c64.log 2>&1
echo "c64 rc=$?"; grep -A4 "^| server | c | pairs | on tok/s" $OUT/s53c64.log | tail -3 | cut -d'|' -f2-9
[ "${C1_S:-130}" != 0 ] && timeout -k 5 ${C1_S:-130} python3 bench/serving.py $A --pairs 2 --min-prompts 16 --configs ngram,ngram-host --concurrency 1 --interleave --json $OUT/s53c1d.json --repeat 1 > $OUT/s53c1d.log 2>&1
echo "c1 rc=$?"; grep -A4 "^| server | c | pairs | on tok/s" $OUT/s53c1d.log | tail -3 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
