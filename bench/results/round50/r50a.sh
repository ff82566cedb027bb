# round 50 call 1: wheels, stage part 1, then the GPU tests of --draft-on-device with the no-match rule (a55b58f), tiny-random
bash .devrun/s1.sh > $OUT/s1.txt 2>&1 || { cat $OUT/s1.txt; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
git log --oneline -1 > $OUT/smi.txt; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $OUT/smi.txt; nproc >> $OUT/smi.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_device_drafts.py tests/test_triton_ngram.py > $OUT/gpu_tests_dd.txt 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests_dd.txt
tail -5 $OUT/gpu_tests_dd.txt; cat $OUT/smi.txt
