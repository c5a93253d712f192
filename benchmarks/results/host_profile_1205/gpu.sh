# Issue 21, one H200 (2026-12-05): where a weight use's host time goes on the GPU host
# (host_profile.py: forward, backward, backward on the calling thread, cProfile), and the
# world-1 125M batch-1 ratios with each round's step kept (step_phases.py rounds_ms).
#   bash benchmarks/results/host_profile_1205/gpu.sh     # about 5 minutes, by value
. benchmarks/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
profile() {
  PYTHONPATH=/tmp/site:$PWD timeout 80 python3 benchmarks/host_profile.py --device cuda \
    --policy $1 --steps 30 --rounds 4 --out $OUT/profile_$1 > $OUT/host_profile_$1.log 2>&1
  echo host_profile $1 rc=$?; tail -4 $OUT/host_profile_$1.log
}
phases() {  # rounds, methods...
  local rounds=$1; shift; local name=phases_w1_125M_b1_$1
  PYTHONPATH=/tmp/site:$PWD timeout 110 python3 benchmarks/step_phases.py --model 125M --batch 1 \
    --fused-adamw --rounds $rounds --warmup 3 --steps 10 --methods "$@" \
    --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo $name rc=$?; grep "^| \(ms per\|step\) " $OUT/$name.log; grep "host_probe\|rounds_ms" $OUT/$name.log
}
profile fp32
phases 10 floor amp gtp_blocks
profile bf16
phases 6 floor_compile amp_compile gtp_compile
