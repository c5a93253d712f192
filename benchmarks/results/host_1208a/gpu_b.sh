# Second call: issue 21's 125M batch-1 eager and compiled ratios on this host, and the host time
# per weight use.   bash benchmarks/results/host_1208a/gpu_b.sh      (carry .whl)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
for run in "eager 120 200 floor floor_per_param gtp_blocks amp" \
           "compiled 160 150 floor_compile gtp_compile amp_compile"; do
  set -- $run
  name=$1 limit=$2 cycles=$3; shift 3
  timeout $limit python3 benchmarks/paired_steps.py --model 125M --batch 1 --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$?"; tail -6 $OUT/$name.log
done
timeout 80 python3 benchmarks/host_overhead.py --device cuda --steps 30 --rounds 3 \
  --out $OUT/host_overhead.json > $OUT/host_overhead.log 2>&1
echo "host_overhead rc=$?"; tail -12 $OUT/host_overhead.log
