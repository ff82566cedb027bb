# Round 48: the CPU proxy at 8 streams (real engine, simulated device, SmolLM2's recorded greedy
# outputs), alternating three drafters N times: in-process n-gram, the remote n-gram on the
# socket (auto branches: on at <= 8 rows), and the remote without branches. Each line: the
# replay pass's tok/s, the executor's CPU per step and the device's idle time before a drafted
# step. Aggregate with proxy_c8_agg.py.   N=10 bash bench/results/round48/proxy_c8.sh > out.txt
P="bench/host_only.py --replay bench/results/round38/serving80.json.gz --concurrency 8 --device-ms 0.85 --device-us-per-token 4 --min-prompts 64 --max-new-tokens 256 --pin --max-draft-len 8 --adaptive"
R="--drafter remote-ngram --drafter-mode socket --drafter-spin-ms 20"
for i in $(seq 1 "${N:-10}"); do
  for name in ngram rem remnb; do
    case $name in
      ngram) a="--drafter ngram" ;;
      rem) a="$R" ;;
      remnb) a="$R --drafter-branches 0" ;;
    esac
    # shellcheck disable=SC2086
    python $P $a 2>&1 | grep " replay: " | sed "s/^/$name /" \
      | grep -o "^[a-z]* \|replay: .*tok/s)\|executor CPU [0-9]* us/step\|drafted [0-9]* us" | tr '\n' ' '
    echo
  done
done
