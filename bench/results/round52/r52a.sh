# round 52 call 1 (fresh machine): wheels, then the GPU tests of pipelined drafting steps (the review mend 99b775b ran on CPU only)
bash .devrun/s1.sh > $OUT/s1a.txt 2>&1 || { cat $OUT/s1a.txt; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/smi_a.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_device_drafts.py tests/test_triton_pipeline.py tests/test_inputs.py > $OUT/gpu_tests_pipe.txt 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests_pipe.txt; tail -15 $OUT/gpu_tests_pipe.txt; cat $OUT/smi_a.txt
