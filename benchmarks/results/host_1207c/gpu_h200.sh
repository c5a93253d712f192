# Issue 21 on the issue's own card, one H200 (141 GB: the paired 1.36B batch-8 harness holds two
# 1.36B models with AdamW state, which ran out of an H100's 80 GB): the 1.36B batch-8 target
# paired (<= 1.05 x floor), then the 125M batch-1 eager and compiled ratios on this host, and
# the host time per weight use (host_overhead.py).
#   bash benchmarks/results/host_1207c/gpu_h200.sh      (carry .whl; needs_h200)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
timeout 180 python3 benchmarks/paired_steps.py --model 1.36B --batch 8 --fused-adamw \
  --cycles 30 --methods floor gtp_blocks --out $OUT/h200_1.36B_b8.json > $OUT/h200_1.36B_b8.log 2>&1
echo "1.36B b8 rc=$?"; tail -5 $OUT/h200_1.36B_b8.log
for run in "eager 110 200 floor floor_per_param gtp_blocks amp" \
           "compiled 150 150 floor_compile gtp_compile amp_compile"; do
  set -- $run
  name=$1 limit=$2 cycles=$3; shift 3
  timeout $limit python3 benchmarks/paired_steps.py --model 125M --batch 1 --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/h200_$name.json > $OUT/h200_$name.log 2>&1
  echo "$name rc=$?"; tail -6 $OUT/h200_$name.log
done
timeout 80 python3 benchmarks/host_overhead.py --device cuda --steps 30 --rounds 3 \
  --out $OUT/host_overhead.json > $OUT/host_overhead.log 2>&1
echo "host_overhead rc=$?"; tail -12 $OUT/host_overhead.log

