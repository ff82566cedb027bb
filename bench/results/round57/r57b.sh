# prepared in round 57 for the next GPU session (no device machine was lent in round 57).
# Before: call 1 of round 56's r56k.sh (wheels, GPU tests) or round 50's s1.sh, the model staged
# in quarters (round 50's s1.sh/join.sh: .modelN/partN -> /tmp/stage, .devrun/join.sh), stubs at
# the device's grpcio (GRPC_GENERATED_VERSION 1.85.3). One call per load, back to back:
#   C=1 bash r57b.sh; C=8 bash r57b.sh; C=32 bash r57b.sh
# Issue 9's one remote configuration: --pipeline-drafts, whose --pipeline-choice is `measured`
# for a remote drafter since round 57 (remote-ngram-socket-pipe), against every drafting step
# pipelined (-pipe-always, round 56's -pipe), synchronous remote steps, and the in-process host
# lookup that sees what a remote drafter sees (ngram-host). bf16, fresh HumanEval prompts, passes
# interleaved server by server. The serving log's policy table says how many steps each load ran
# pipelined and synchronous. The speculation-off passes check d84994e (a pipelined step after one
# without drafts moves no row): the pipelined servers' host ms a plain step should now be the
# synchronous remote server's (round 56: 1.39-1.51 against 1.15-1.29 at 32 streams).
source .devrun/join.sh > /dev/null 2>&1
C=${C:-8}
case $C in 1) MP=16 PAIRS=2 ;; 8) MP=128 PAIRS=3 ;; *) MP=256 PAIRS=2 ;; esac
A="--model smollm2-135m --device cuda --max-batch-size 64 --max-num-tokens 1024 --metrics --paired --pass-factor 2 --max-new-tokens 256 --kinds all --client-procs 4 --configs ngram-host,remote-ngram-socket,remote-ngram-socket-pipe,remote-ngram-socket-pipe-always --interleave --repeat 1"
timeout -k 5 ${T_S:-540} python3 bench/serving.py $A --pairs ${PAIRS} --min-prompts $MP --concurrency $C --json $OUT/s57c$C.json > $OUT/s57c$C.log 2>&1; echo "c$C rc=$?"
grep -A6 "^| server | c | pairs | on tok/s" $OUT/s57c$C.log | tail -5 | cut -d'|' -f2-9
grep "pipelined .* / synchronous" $OUT/s57c$C.log | cut -c1-200 | tail -8
gzip -f $OUT/*.json 2>/dev/null; true
