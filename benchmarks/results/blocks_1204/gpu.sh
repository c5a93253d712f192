# Issue 26, one H200, world 1: bench_step's floor, gtp, gtp_blocks and fsdp2 at 125M batch 1, 4,
# 8 and 1.36B batch 1, 8, each beside the host probe; predicted first (predict_first.py).
. benchmarks/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=/tmp/site:$PWD timeout 540 torchrun --nproc_per_node 1 benchmarks/bench_step.py --methods floor gtp gtp_blocks fsdp2 --plan "125M:1,4,8;1.36B:1,8" --fused-adamw --rounds 2 --out $OUT > $OUT/bench.log 2>&1
echo bench rc=$?; tail -30 $OUT/bench.log; ls $OUT
