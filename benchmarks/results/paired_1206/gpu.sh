# Issue 21, one GPU (2026-12-06): the 125M batch-1 targets read with methods taking turns a step
# at a time (paired_steps.py): eager twice, minutes apart, compiled once; then the engine's host
# time per weight use (host_overhead.py). About 5 minutes.
#   bash benchmarks/results/paired_1206/gpu.sh
# Then, here: python benchmarks/stored_runs.py h100 benchmarks/results/paired_1206/eager_*.json
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
paired() {  # name timeout cycles methods...
  local name=$1 limit=$2 cycles=$3; shift 3
  timeout $limit python3 benchmarks/paired_steps.py --model 125M --batch 1 --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$?"; tail -7 $OUT/$name.log
}
paired eager_a 150 300 floor gtp_blocks gtp amp
paired compiled 300 200 floor_compile gtp_compile amp_compile
paired eager_b 150 300 floor gtp_blocks gtp amp
timeout 170 python3 benchmarks/host_overhead.py --device cuda --steps 100 --rounds 7 \
  --out $OUT/host_overhead.json > $OUT/host_overhead.log 2>&1
echo "host_overhead rc=$?"; tail -12 $OUT/host_overhead.log
