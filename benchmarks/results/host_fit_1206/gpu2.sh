# Issue 21, one GPU (2026-12-06), a second look (about 2 minutes): 125M batch-1 eager steps of
# this tree against the tree before interception stayed off through zero_grad, 300 cycles.
#   bash benchmarks/results/host_fit_1206/gpu2.sh     (carry .whl and .old)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 200 python3 benchmarks/paired_steps.py --model 125M --batch 1 --fused-adamw \
  --cycles 300 --methods floor gtp_blocks gtp --baseline .old --out $OUT/eager_base_b.json \
  > $OUT/eager_base_b.log 2>&1
echo "eager_base_b rc=$?"; tail -9 $OUT/eager_base_b.log
