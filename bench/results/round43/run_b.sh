# run B (one call after run A): remote only, old then new
source .devrun/join.sh; cp -r specwire/v1 .old/specwire/v1; A="(as run A)"
for t in old new; do d=$PWD; [ $t = old ] && d=$PWD/.old; (cd $d && PYTHONPATH=/tmp/site:$d:$d/tests timeout -k 5 170 python3 bench/serving.py $A --configs remote-ngram-socket --concurrency 8 --json $OUT/s43c8r_$t.json --repeat 1 > $OUT/s43c8r_$t.log 2>&1); done
