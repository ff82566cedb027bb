# round 45 call A: main (the policy fix) in-process vs remote (socket), interleaved, 1 stream (phase timer on); then the GPU tests
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 32 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/smi.txt; git log --oneline -1 >> $OUT/smi.txt; nproc >> $OUT/smi.txt
mkdir -p /tmp/ph1
PHASES_EXTRA="$(cat .devrun/extra.txt)" PHASES_DIR=/tmp/ph1 PYTHONPATH=$PWD/bench/phase_timer:$PYTHONPATH timeout -k 5 200 python3 bench/serving.py $A --configs ngram,remote-ngram-socket --concurrency 1 --interleave --json $OUT/s45c1.json --repeat 1 > $OUT/s45c1.log 2>&1
echo "c1 rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/s45c1.log | tail -2 | cut -d'|' -f2-9
grep -A6 "^## Side by side" $OUT/s45c1.log | tail -4
(cd /tmp && tar czf $OUT/ph1.tgz ph1); for f in /tmp/ph1/*.txt; do head -1 $f | cut -c1-100; sed -n 2p $f | cut -c1-200; done
timeout -k 5 240 python3 -m pytest -q -s -m gpu tests/test_gpu.py > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests.log
gzip -f $OUT/*.json 2>/dev/null
