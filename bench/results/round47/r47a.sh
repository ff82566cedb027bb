nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $OUT/smi.txt
git log --oneline | head -1 >> $OUT/smi.txt
python3 -c "import triton; print('triton', triton.__version__)" >> $OUT/smi.txt
for s in "llama3-8b 32 5"; do set -- $s
  timeout 45 ncu --clock-control none -k regex:"_paged_attention_kernel|_combine_kernel" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    python3 .devrun/ncu_attn.py $1 $2 $3 > $OUT/ncu_$1_$2_$3.txt 2>&1; echo ncu rc $?
done
timeout 150 python3 .devrun/attn_sweep.py > $OUT/sweep.txt 2>&1; echo sweep rc $?
python3 .devrun/pick.py $OUT/sweep.txt > /tmp/best.txt 2>> $OUT/smi.txt; cat /tmp/best.txt; read SEG TILE ST NREG < /tmp/best.txt
VS="--device cuda --shapes llama3-8b,smollm2 --batches 1,32,64 --ks 4 --ctx 1024 --iters 30 --out /tmp/vsout"
timeout 70 python3 .devrun/att_env.py bench/verify_step.py $VS --tag _default > $OUT/vs_default.log 2>&1
ATT_SEG=$SEG ATT_TILE=$TILE ATT_STAGES=$ST ATT_MAXNREG=$NREG timeout 70 python3 .devrun/att_env.py bench/verify_step.py $VS --tag _best > $OUT/vs_best.log 2>&1
grep -h "replay" $OUT/vs_default.log $OUT/vs_best.log | cut -c1-150
ATT_SEG=$SEG ATT_TILE=$TILE ATT_STAGES=$ST ATT_MAXNREG=$NREG timeout 50 python3 .devrun/att_env.py pytest -q -x tests/test_triton_attention.py > $OUT/t_attn_best.log 2>&1; tail -2 $OUT/t_attn_best.log
