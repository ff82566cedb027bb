# round 43: bf16, 8 streams, in-process and remote (socket): new then c76d4f4 (old); then GPU tests on this tree
source .devrun/join.sh > /dev/null 2>&1
cp -r specwire/v1 .old/specwire/v1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 128 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
run() {  # tree name timeout args...
  t=$1; n=$2; to=$3; shift 3
  d=$PWD; [ $t = old ] && d=$PWD/.old
  (cd $d && PYTHONPATH=/tmp/site:$d:$d/tests timeout -k 5 $to python3 bench/serving.py "$@" --json $OUT/$n.json --repeat 1 > $OUT/$n.log 2>&1)
  echo "$n rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/$n.log | tail -2 | cut -d'|' -f2-9
}
run new s43c8new 190 $A --configs ngram,remote-ngram-socket --concurrency 8
run old s43c8old 190 $A --configs ngram,remote-ngram-socket --concurrency 8
timeout -k 5 200 python3 -m pytest -q -s -m gpu tests/test_gpu.py > $OUT/gpu_tests.log 2>&1
echo gpu tests rc=$?; tail -2 $OUT/gpu_tests.log
gzip -f $OUT/*.json 2>/dev/null
