# round 57, dev VM (2 cores): the remote n-gram drafter synchronous, every drafting step pipelined,
# and --pipeline-choice measured, alternating, two runs each, in the host-only proxy (real
# engine, drafter service and gRPC; the model a stub replaying recorded greedy outputs; a
# simulated device of 0.85 ms + US us per token).  bash proxy.sh C PROMPTS [US]
cd "$(dirname "$0")/../../.." && . .venv/bin/activate
C=${1:-32}; MP=${2:-64}; US=${3:-4}
B="python3 bench/host_only.py --replay bench/results/round38/serving80.json.gz --concurrency $C --pass-factor 1 --device-ms 0.85 --device-us-per-token $US --min-prompts $MP --max-new-tokens 256 --max-batch-size 64 --max-draft-len 8 --adaptive --pin --drafter remote-ngram --drafter-mode socket --drafter-spin-ms 20"
for rep in 1 2; do
  $B 2>&1 | grep "host-only" | grep -v "counters\|EMAs"
  $B --pipeline-drafts --pipeline-choice always 2>&1 | grep "host-only" | grep -v "counters\|EMAs"
  $B --pipeline-drafts --pipeline-choice measured 2>&1 | grep "host-only" | grep -v "counters\|EMAs"
done
