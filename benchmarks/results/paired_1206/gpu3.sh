# Issue 21, one GPU (2026-12-06): where eager gtp_blocks' host time beyond the floor's goes at
# 125M batch 1: each method profiled (torch.profiler's ops table with kernel launches, and a
# cProfile with backward on the calling thread). About 2 minutes.
#   bash benchmarks/results/paired_1206/gpu3.sh     (METHODS="...": others than floor gtp_blocks)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
for m in ${METHODS:-floor gtp_blocks}; do
  timeout 120 torchrun --nproc_per_node 1 benchmarks/profile_gtp.py --model 125M --batch 1 \
    --method $m --fused-adamw --steps 20 --cprofile --one-thread --out $OUT/prof_$m \
    > $OUT/prof_$m.log 2>&1
  echo "$m rc=$?"; grep '"step_ms"' $OUT/prof_$m.log
  grep -E "cudaLaunchKernel|Self CPU time total|cudaMemcpyAsync" $OUT/prof_$m/ops_rank0.txt
done
