# round 53 (model staged, little device time): SmolLM2 GPU tests of the new CUDA default (device lookup in pipelined steps): lossless fp32 (default and host lookup), no eager steps, bf16 exact
source .devrun/join.sh > /dev/null 2>&1
timeout ${T_S:-150} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "test_lossless_fp32_with_cuda_graphs or no_eager or bf16_speculation" > $OUT/gpu_default.txt 2>&1; echo "rc=$?" >> $OUT/gpu_default.txt; grep -E "identical|steps|passed|failed|rc=|Error" $OUT/gpu_default.txt | tail -20
