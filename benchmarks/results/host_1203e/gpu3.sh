. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
SP="benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw --rounds 10"
timeout 300 torchrun --nproc_per_node 1 $SP --methods floor gtp_blocks floor_compile gtp_compile --baseline .whl/base3 --out $OUT/phases_cast_together_r10.json > $OUT/phases_r10.log 2>&1
echo phases rc=$?
tail -20 $OUT/phases_r10.log | head -8
timeout 240 torchrun --nproc_per_node 1 benchmarks/bench_step.py --plan 125M:1 --methods floor amp gtp_blocks floor_compile amp_compile gtp_compile --fused-adamw --rounds 2 --out $OUT > $OUT/bench.log 2>&1
echo bench rc=$?
tail -12 $OUT/bench.log
