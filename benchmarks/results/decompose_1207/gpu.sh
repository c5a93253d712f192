# Issue 21, one GPU, one call of about 5 minutes: where gtp_blocks' step at 125M batch 1 spends
# what the floor's does not. floor_per_param is the floor with its AdamW over one tensor per
# parameter, as GTP's shards are, so gtp_blocks / floor_per_param is the engine's share alone.
# Then the compiled steps of this tree.
#   bash benchmarks/results/decompose_1207/gpu.sh      (carry .whl)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
RC=0
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
for run in "eager 110 200 floor floor_per_param gtp_blocks amp" \
           "compiled 150 100 floor_compile gtp_compile amp_compile"; do
  set -- $run
  name=$1 limit=$2 cycles=$3; shift 3
  timeout $limit python3 benchmarks/paired_steps.py --model 125M --batch 1 --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  rc=$?; echo "$name rc=$rc"; tail -7 $OUT/$name.log
  [ $rc -gt $RC ] && RC=$rc
done
# The optimizer step alone, plain, wrapped, and wrapped inside torch's subclass switch: what the
# per-parameter __torch_function__ check costs on this host (RESULTS.md, 2026-12-07, second session).
timeout 120 python3 benchmarks/results/decompose_1207/optimizer_switch.py --model 125M \
  > $OUT/optimizer_switch.log 2>&1
rc=$?; echo "optimizer_switch rc=$rc"; tail -3 $OUT/optimizer_switch.log
[ $rc -gt $RC ] && RC=$rc
exit $RC
