# round 44 call P: where the remote's extra host time goes on the GPU host: the executor's phases timed
# (.devrun/prof/sitecustomize.py, PHASES_DIR), 1 and 8 streams, in-process vs remote (socket)
source .devrun/join.sh > /dev/null 2>&1
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pairs 2 --min-prompts 32 --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4"
for c in 1 8; do
  mkdir -p $OUT/ph$c
  mp=32; [ $c = 8 ] && mp=128
  PHASES_DIR=$OUT/ph$c PYTHONPATH=$PWD/.devrun/prof:$PYTHONPATH timeout -k 5 150 python3 bench/serving.py ${A/--min-prompts 32/--min-prompts $mp} --configs ngram,remote-ngram-socket --concurrency $c --json $OUT/p44c$c.json --repeat 1 > $OUT/p44c$c.log 2>&1
  echo c=$c rc=$?; grep -A3 "^| server | c | pairs | on tok/s" $OUT/p44c$c.log | tail -2 | cut -d'|' -f2-9
  for f in $OUT/ph$c/*.txt; do head -1 $f | cut -c1-80; sed -n 2p $f | cut -c1-200; done
done
gzip -f $OUT/*.json 2>/dev/null
