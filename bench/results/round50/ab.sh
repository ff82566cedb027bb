# A/B in the CPU proxy at 8 streams: base (f37f146 worktree) vs new (/work/main), in-process and remote n-gram, alternated
P="bench/host_only.py --replay bench/results/round38/serving80.json.gz --concurrency ${C:-8} --device-ms 0.85 --device-us-per-token 4 --min-prompts 64 --max-new-tokens 256 --pin --max-draft-len 8 --adaptive"
R="--drafter remote-ngram --drafter-mode socket --drafter-spin-ms 20"
for i in $(seq 1 "${N:-6}"); do
  for tree in base new; do
    dir=/tmp/base; [ $tree = new ] && dir=/work/main
    for d in ngram rem; do
      a="--drafter ngram"; [ $d = rem ] && a="$R"
      (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python $P $a 2>&1 | grep " replay: " | sed "s/^/$tree-$d /" \
        | grep -o "^[a-z-]* \|replay: .*tok/s)\|executor CPU [0-9]* us/step\|drafted [0-9]* us" | tr '\n' ' '; echo)
    done
  done
done
