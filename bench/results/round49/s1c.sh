# round 49 call 1: wheels + stage part 1 (s1.sh); GPU tests of --draft-on-device (tiny-random, no model file needed); the kernel's cost
bash .devrun/s1.sh
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
git log --oneline -1 > $OUT/smi1.txt; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $OUT/smi1.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_device_drafts.py tests/test_triton_ngram.py tests/test_bench_tools.py -k "device or ngram" > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests.txt
tail -15 $OUT/gpu_tests.txt
D="python3 bench/device_ngram.py --device cuda"
( $D --impl kernel --check 300 --outputs bench/results/round38/serving80.json.gz
  $D --impl kernel --rows 1,8,32,64 --ctx 512,2048,8192 --iters 200
  $D --impl kernel --no-graph --rows 8,64 --ctx 2048 --iters 200
  $D --impl kernel --block 256 --rows 1,8,32,64 --ctx 512,2048 --iters 200
  $D --rows 8,64 --ctx 2048 --iters 100 ) > $OUT/device_ngram.txt 2>&1
cat $OUT/device_ngram.txt | tail -40
