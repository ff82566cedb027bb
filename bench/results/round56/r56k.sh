# call 1 on a fresh machine: wheels into /tmp/site, the GPU KV-pool check test, then the tiny-model GPU tests of the default path
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/smi.txt
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu "tests/test_loading.py::test_kv_cache_bigger_than_the_gpu_is_refused_and_one_that_fits_is_zero" > $OUT/gpu_kv.txt 2>&1; echo "rc=$?" >> $OUT/gpu_kv.txt; tail -5 $OUT/gpu_kv.txt
timeout ${T1_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_device_drafts.py tests/test_triton_pipeline.py tests/test_inputs.py > $OUT/gpu_tiny.txt 2>&1; echo "rc=$?" >> $OUT/gpu_tiny.txt; tail -5 $OUT/gpu_tiny.txt
