. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
SP="benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw --rounds 4"
timeout 330 torchrun --nproc_per_node 1 $SP --methods floor gtp_blocks floor_compile gtp_compile --baseline .whl/base3 --out $OUT/phases_cast_together.json > $OUT/phases.log 2>&1
echo phases rc=$?
tail -25 $OUT/phases.log
OUT=$OUT timeout 200 python3 .whl/prof_compile.py cuda 125M gtp_blocks,gtp_compile > $OUT/prof2.txt 2>&1
echo prof rc=$?
grep "step ms\|busy" $OUT/prof2.txt
