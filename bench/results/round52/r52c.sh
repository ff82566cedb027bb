# round 52 (model staged, little device time left): the remote drafter in pipelined steps on the GPU (fp32 lossless tests), then bf16 serving at 8 streams, one pair each, interleaved
source .devrun/join.sh > /dev/null 2>&1
timeout ${T_S:-70} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "remote_drafter_in_pipelined" > $OUT/gpu_remote_pipe.txt 2>&1; echo "rc=$?" >> $OUT/gpu_remote_pipe.txt; grep -E "identical|passed|failed|rc=" $OUT/gpu_remote_pipe.txt
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
timeout -k 5 ${C8_S:-110} python3 bench/serving.py $A --pairs 1 --min-prompts 64 --configs ngram-pipe,remote-ngram-socket,remote-ngram-socket-pipe --concurrency 8 --interleave --json $OUT/s52c8.json --repeat 1 > $OUT/s52c8.log 2>&1
echo "c8 rc=$?"; grep -A6 "^| server | c | pairs | on tok/s" $OUT/s52c8.log | tail -5 | cut -d'|' -f2-9
gzip -f $OUT/*.json 2>/dev/null
