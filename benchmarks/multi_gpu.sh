#!/usr/bin/env bash
# Issue 26's runs on a 4- or 8-GPU machine, one stage per device call (each within 600 s):
#
#   bash benchmarks/multi_gpu.sh tests       # NCCL parity at 2, 4, 8 and dp x gtp meshes
#   bash benchmarks/multi_gpu.sh bench       # bench_step on every GPU: one gtp axis, then dp=2
#   bash benchmarks/multi_gpu.sh calibrate   # the cost model's collectives at 2..GPUs, steps
#
# Carry .whl (the Hydra wheels). Results under $OUT; the bench JSONs join a calibration with
# benchmarks/stored_runs.py-style scripts, `gtp-plan validate --cluster FILE` reads them.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh" >/dev/null
export PYTHONPATH=/tmp/site:$PWD
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $GPUS"
bench() {  # name timeout extra-args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" torchrun --nproc_per_node "$GPUS" benchmarks/bench_step.py --fused-adamw \
    --rounds 2 --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -v Warning "$OUT/$name.log" | tail -14
}
case "${1:-}" in
  tests)
    timeout 560 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$OUT/tests.log" 2>&1
    echo "tests rc=$?"; tail -4 "$OUT/tests.log" ;;
  bench)
    bench gtp_axis 330 --methods floor fsdp2 gtp gtp_blocks gtp_graph --plan "125M:1,8;1.36B:1,8"
    bench dp2 230 --dp 2 --methods floor fsdp2 gtp_blocks --plan "125M:1;1.36B:1,8" ;;
  calibrate)
    timeout 560 python3 benchmarks/calibrate.py --model gpt_1p36b --batches 1 8 --budget-s 500 \
      --out "$OUT/calibrated_${GPUS}gpu.json" > "$OUT/calibrate.log" 2>&1
    echo "calibrate rc=$?"; tail -6 "$OUT/calibrate.log" ;;
  *) echo "usage: $0 tests|bench|calibrate" >&2; exit 2 ;;
esac
