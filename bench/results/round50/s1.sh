# call 1 on a fresh machine: wheels into /tmp/site, stage the model's first quarter
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/stage; [ -f .model1/part1 ] && cp .model1/part1 /tmp/stage/; ls -la /tmp/stage /tmp/site | head -30
nvidia-smi --query-gpu=name,memory.total --format=csv
