# Issue 21, one GPU, one call of about 8 minutes: what a block call's primitives cost on this
# host (primitives.py), where the 125M batch-1 eager step spends the engine's time
# (step_phases.py's timed functions), the paired eager and compiled ratios on this host, and,
# on an H200 (141 GB: both 1.36B models fit), the 1.36B batch-8 target paired.
#   bash benchmarks/results/host_1207c/gpu.sh      (carry .whl)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
timeout 60 python3 benchmarks/results/host_1207c/primitives.py --device cuda > $OUT/primitives.log 2>&1
echo "primitives rc=$?"; cat $OUT/primitives.log
timeout 100 python3 benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw --rounds 3 \
  --methods floor_per_param gtp_blocks gtp --out $OUT/phases_125M_b1.json > $OUT/phases_125M_b1.log 2>&1
echo "phases rc=$?"; tail -24 $OUT/phases_125M_b1.log
for run in "eager 110 200 floor floor_per_param gtp_blocks amp" \
           "compiled 150 150 floor_compile gtp_compile amp_compile"; do
  set -- $run
  name=$1 limit=$2 cycles=$3; shift 3
  timeout $limit python3 benchmarks/paired_steps.py --model 125M --batch 1 --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$?"; tail -6 $OUT/$name.log
done
case "$GPU" in *H200*)
  timeout 150 python3 benchmarks/paired_steps.py --model 1.36B --batch 8 --fused-adamw \
    --cycles 30 --methods floor gtp_blocks --out $OUT/paired_1.36B_b8.json > $OUT/paired_1.36B_b8.log 2>&1
  echo "1.36B b8 rc=$?"; tail -5 $OUT/paired_1.36B_b8.log ;;
esac
