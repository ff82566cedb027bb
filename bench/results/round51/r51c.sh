# round 51 call 1 (fresh machine): wheels, then the GPU tests of the pipeline's Triton launches and of drafting on the device
bash .devrun/s1.sh > $OUT/s1c.txt 2>&1 || { cat $OUT/s1c.txt; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/smi_c.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_pipeline.py tests/test_device_drafts.py tests/test_inputs.py tests/test_triton_ngram.py > $OUT/gpu_tests_pipe2.txt 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests_pipe2.txt; tail -25 $OUT/gpu_tests_pipe2.txt; cat $OUT/smi_c.txt
