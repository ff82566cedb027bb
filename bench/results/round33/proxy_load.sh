#!/bin/bash
# Round 33 proxy under load: none, in-process and remote (stream, socket), --pin, c=8 and 32.
cd "$(dirname "$0")/../../.."
A="--replay bench/results/round24/greedy80.json.gz --pass-factor 2 --device-ms 1.0 --device-us-per-token 15 --min-prompts 48 --max-new-tokens 128 --adaptive --draft-lengths --pin"
for c in 8 32; do
 for r in 1 2; do
  for d in "none" "ngram" "remote-ngram --drafter-mode stream" "remote-ngram --drafter-mode socket"; do
   echo "### c=$c round=$r drafter=$d"
   .venv/bin/python bench/host_only.py $A --concurrency $c --drafter $d 2>&1 | grep -v "warm-up"
  done
 done
done
