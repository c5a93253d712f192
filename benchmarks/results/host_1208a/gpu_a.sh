# First call of 2026-12-08 on one H200: the graphed-region fix and the gpu-marked MoE tests
# (never yet run on CUDA), then issue 21's 1.36B batch-8 paired target (needs the H200's memory).
#   bash benchmarks/results/host_1208a/gpu_a.sh      (carry .whl; needs_h200)
bash benchmarks/results/host_1207f/gpu_min.sh
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
timeout 200 python3 benchmarks/paired_steps.py --model 1.36B --batch 8 --fused-adamw \
  --cycles 30 --methods floor gtp_blocks --out $OUT/h200_1.36B_b8.json > $OUT/h200_1.36B_b8.log 2>&1
echo "1.36B b8 rc=$?"; tail -5 $OUT/h200_1.36B_b8.log
