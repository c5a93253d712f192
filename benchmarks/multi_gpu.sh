#!/usr/bin/env bash
# Issue 26's runs on a 4- or 8-GPU machine, one stage per device call (each within 600 s):
#
#   bash benchmarks/multi_gpu.sh tests       # NCCL parity at 2, 4, 8 and dp x gtp meshes
#   bash benchmarks/multi_gpu.sh bench       # bench_step on every GPU, one gtp axis
#   bash benchmarks/multi_gpu.sh bench_dp    # the same with --dp 2 (GTP on dp x gtp, HSDP)
#   bash benchmarks/multi_gpu.sh calibrate   # the cost model's collectives at 2..GPUs, steps
#
# Carry .whl (the Hydra wheels). Results under $OUT; the bench JSONs join a calibration with
# benchmarks/stored_runs.py-style scripts, `gtp-plan validate --cluster FILE` reads them.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh" >/dev/null
export PYTHONPATH=/tmp/site:$PWD
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $GPUS"
RC=0  # the worst exit status of the stage's programs, the script's own
bench() {  # name timeout extra-args...
  local name=$1 limit=$2 rc; shift 2
  timeout "$limit" torchrun --nproc_per_node "$GPUS" benchmarks/bench_step.py --fused-adamw \
    --rounds 2 --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  rc=$?; echo "$name rc=$rc"; grep -v Warning "$OUT/$name.log" | tail -14
  [ $rc -gt $RC ] && RC=$rc
}
case "${1:-}" in
  tests)
    timeout 560 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$OUT/tests.log" 2>&1
    RC=$?; echo "tests rc=$RC"; tail -4 "$OUT/tests.log" ;;
  bench)
    bench gtp_axis 560 --methods floor fsdp2 gtp gtp_blocks gtp_graph --plan "125M:1,8;1.36B:1,8" ;;
  bench_dp)
    bench dp2 560 --dp 2 --methods floor fsdp2 gtp gtp_blocks --plan "125M:1,8;1.36B:1,8" ;;
  calibrate)
    timeout 560 python3 benchmarks/calibrate.py --model gpt_1p36b --batches 1 8 --budget-s 500 \
      --out "$OUT/calibrated_${GPUS}gpu.json" > "$OUT/calibrate.log" 2>&1
    RC=$?; echo "calibrate rc=$RC"; tail -6 "$OUT/calibrate.log" ;;
  *) echo "usage: $0 tests|bench|bench_dp|calibrate" >&2; exit 2 ;;
esac
exit $RC
