# prepared in round 56 for the next GPU session (model staged: source .devrun/join.sh; carry .old/c9de7a5 made by
#   rm -rf .old/c9de7a5 && mkdir -p .old/c9de7a5 && git archive c9de7a5 specwire tests/procs.py | tar -x -C .old/c9de7a5 && cp -r specwire/v1 .old/c9de7a5/specwire/)
# 1. this round's GPU test twin (graph staging of a pipelined step without drafts)
# 2. the spawn-first start against c9de7a5, alternating (warm Triton cache after the first start)
# 3. speculation-off passes at 32 streams, where the no-draft fast path should show (host ms/step)
source .devrun/join.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_device_drafts.py -k "some_or_no or pipelined" > $OUT/gpu_pipe.txt 2>&1; echo "rc=$?"; tail -3 $OUT/gpu_pipe.txt
timeout -k 5 ${ST_S:-300} python3 bench/startup.py --device cuda --runs 3 --trees .old/c9de7a5,. > $OUT/startup_ab.txt 2>&1; echo "startup rc=$?"; tail -5 $OUT/startup_ab.txt
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4 --configs ngram,ngram-host,remote-ngram-socket,remote-ngram-socket-pipe --interleave --repeat 1"
timeout -k 5 ${C32_S:-420} python3 bench/serving.py $A --pairs 2 --min-prompts 256 --concurrency 32 --json $OUT/s57c32.json > $OUT/s57c32.log 2>&1; echo "c32 rc=$?"; grep -A8 "^| pass | ngram tok/s" $OUT/s57c32.log | head -7
gzip -f $OUT/*.json 2>/dev/null; true
