# round 50, fresh machine call 1: wheels, then the GPU tests of device drafting after plain steps skip the drafting inputs (48be734)
bash .devrun/s1.sh > $OUT/s1e.txt 2>&1 || { cat $OUT/s1e.txt; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/smi_e.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_device_drafts.py tests/test_triton_ngram.py > $OUT/gpu_tests_dd2.txt 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests_dd2.txt; tail -2 $OUT/gpu_tests_dd2.txt; cat $OUT/smi_e.txt
