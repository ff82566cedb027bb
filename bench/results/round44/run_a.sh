# round 44 call A: main as it stands (6495c13): 32 streams in-process vs remote (socket); 8 streams remote with vs without branches
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 128 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
run() {  # name timeout args...
  n=$1; to=$2; shift 2
  timeout -k 5 $to python3 bench/serving.py "$@" --json $OUT/$n.json --repeat 1 > $OUT/$n.log 2>&1
  echo "$n rc=$?"; grep -A3 "^| server | c | pairs | on tok/s" $OUT/$n.log | tail -2 | cut -d'|' -f2-9
  grep -A6 "^## Side by side" $OUT/$n.log | tail -4
}
run s44c32 230 $A --configs ngram,remote-ngram-socket --concurrency 32
run s44c8b 200 $A --configs remote-ngram-socket,remote-ngram-socket-nobranch --concurrency 8
gzip -f $OUT/*.json 2>/dev/null
