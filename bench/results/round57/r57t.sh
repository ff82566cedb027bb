# prepared in round 57 for the next GPU session (model staged: source .devrun/join.sh, as r57b.sh):
# the GPU tests this round and round 56 added and could not run: a remote-drafter target
# switching between pipelined and synchronous drafting steps (graphs, fp32), and round 56's
# pipelined steps where some or no request speculates ([cuda-graphs] twin).
source .devrun/join.sh > /dev/null 2>&1
timeout ${T_S:-300} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "in_pipelined_steps" > $OUT/gpu_switch.txt 2>&1; echo "rc=$?"; grep -E "identical|passed|failed" $OUT/gpu_switch.txt | tail -6
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_device_drafts.py -k "some_or_no or pipelined" > $OUT/gpu_pipe.txt 2>&1; echo "rc=$?"; tail -3 $OUT/gpu_pipe.txt
