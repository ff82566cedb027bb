# round 44 call Q: does the remote drafter's polling for replies while the device runs (device_running)
# cost the GPU host more than it saves? 8 streams, remote (socket) only, on/off alternating (env switch in
# .devrun/prof/sitecustomize.py); the CPU topology first
source .devrun/join.sh > /dev/null 2>&1
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name|NUMA node0" | tee $OUT/lscpu.txt
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 128 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
i=0
for dr in on off off on; do
  i=$((i+1)); E=""; [ $dr = off ] && E="PROF_NO_DEVICE_RUNNING=1"
  env $E PYTHONPATH=$PWD/.devrun/prof:$PYTHONPATH timeout -k 5 95 python3 bench/serving.py $A --configs remote-ngram-socket --concurrency 8 --json $OUT/q44_${i}_$dr.json --repeat 1 > $OUT/q44_${i}_$dr.log 2>&1
  echo "run $i dr=$dr rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/q44_${i}_$dr.log | tail -1 | cut -d'|' -f2-9
  grep -A6 "^| pass | steps spec" $OUT/q44_${i}_$dr.log | sed -n 3p | cut -d'|' -f2-4,7
done
gzip -f $OUT/*.json 2>/dev/null
