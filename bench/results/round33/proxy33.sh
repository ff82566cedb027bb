#!/bin/bash
# Round 33 proxy: in-process vs remote modes, with and without --pin, three rounds, alternating.
cd /work/main
A="--replay bench/results/round24/greedy80.json.gz --concurrency 1 --pass-factor 2 --device-ms 1.0 --device-us-per-token 15 --min-prompts 24 --max-new-tokens 128 --adaptive --draft-lengths"
for pin in "" "--pin"; do
 for r in 1 2 3; do
  for d in "ngram" "remote-ngram --drafter-mode stream" "remote-ngram --drafter-mode relay" "remote-ngram --drafter-mode socket" "remote-ngram --drafter-mode socket --drafter-wait-rule gain"; do
   echo "### pin=${pin:-no} round=$r drafter=$d"
   .venv/bin/python bench/host_only.py $A $pin --drafter $d 2>&1 | grep -v "warm-up"
  done
 done
done
