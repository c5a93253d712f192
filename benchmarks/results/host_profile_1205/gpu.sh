# Issue 21, one H200 (2026-12-05): where a weight use's host time goes on the GPU host
# (host_profile.py: forward, backward, backward on the calling thread, cProfile), and the
# world-1 125M batch-1 ratios with each round's step kept (step_phases.py rounds_ms).
#   bash benchmarks/results/host_profile_1205/gpu.sh     # about 4 minutes
. benchmarks/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
for policy in fp32 bf16; do
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/host_profile.py --device cuda \
    --policy $policy --out $OUT/profile_$policy > $OUT/host_profile_$policy.log 2>&1
  echo host_profile $policy rc=$?; tail -4 $OUT/host_profile_$policy.log
done
for cfg in "12 floor amp gtp_blocks" "8 floor_compile amp_compile gtp_compile"; do
  set -- $cfg; rounds=$1; shift; name=phases_w1_125M_b1_$1
  PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/step_phases.py --model 125M --batch 1 \
    --fused-adamw --rounds $rounds --warmup 3 --steps 10 --methods "$@" \
    --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo $name rc=$?; grep "^| \(ms per\|step\) " $OUT/$name.log; grep "host_probe\|rounds_ms" $OUT/$name.log
done
