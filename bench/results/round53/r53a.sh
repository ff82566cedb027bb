# round 53 (model staged): fp32 GPU test of the remote drafter in pipelined steps, then bf16 serving c1 and c8 interleaved
source .devrun/join.sh > /dev/null 2>&1
timeout ${T_S:-80} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "remote_drafter_in_pipelined" > $OUT/gpu_remote_pipe.txt 2>&1; echo "rc=$?" >> $OUT/gpu_remote_pipe.txt; grep -E "identical|passed|failed|rc=" $OUT/gpu_remote_pipe.txt
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 ${C1_S:-170} python3 bench/serving.py $A --pairs ${C1_P:-2} --min-prompts 16 --configs ngram-pipe,remote-ngram-socket,remote-ngram-socket-pipe --concurrency 1 --interleave --json $OUT/s53c1.json --repeat 1 > $OUT/s53c1.log 2>&1
echo "c1 rc=$?"; grep -A5 "^| server | c | pairs | on tok/s" $OUT/s53c1.log | tail -4 | cut -d'|' -f2-9
timeout -k 5 ${C8_S:-200} python3 bench/serving.py $A --pairs ${C8_P:-2} --min-prompts 64 --configs ngram-pipe,remote-ngram-socket,remote-ngram-socket-pipe --concurrency 8 --interleave --json $OUT/s53c8.json --repeat 1 > $OUT/s53c8.log 2>&1
echo "c8 rc=$?"; grep -A6 "^| server | c | pairs | on tok/s" $OUT/s53c8.log | tail -5 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
