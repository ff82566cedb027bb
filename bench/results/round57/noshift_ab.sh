# old (HEAD e9afcd2) vs new (working tree), speculation off, c32, alternating, 3 runs
for rep in 1 2 3; do
for tree in /tmp/old57 /work/main; do
cd $tree && . /work/main/.venv/bin/activate
B="python3 bench/host_only.py --replay bench/results/round38/serving80.json.gz --concurrency 32 --pass-factor 1 --device-ms 0.85 --device-us-per-token 4 --min-prompts 64 --max-new-tokens 256 --max-batch-size 64 --max-draft-len 8 --adaptive --pin --speculation-off"
echo "$tree device-pipelined: $($B --drafter ngram --draft-on-device --pipeline-drafts 2>&1 | grep -E 'c=32|replay:' | grep -o 'executor CPU [0-9]* us/step' | tr '\n' ' ')"
echo "$tree remote-pipelined: $($B --drafter remote-ngram --drafter-mode socket --drafter-spin-ms 20 --pipeline-drafts --pipeline-choice always 2>&1 | grep -E 'c=32|replay:' | grep -o 'executor CPU [0-9]* us/step' | tr '\n' ' ')"
done; done
