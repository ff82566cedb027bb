# fresh machine: wheels, then the GPU tests of pipelined steps (this round's change: steps where no row has drafts stage no verification)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_device_drafts.py tests/test_triton_pipeline.py > $OUT/gpu_pipe.txt 2>&1; echo "rc=$?" >> $OUT/gpu_pipe.txt; tail -6 $OUT/gpu_pipe.txt
