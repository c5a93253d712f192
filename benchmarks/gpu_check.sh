#!/usr/bin/env bash
# One device call: the CUDA tests on the GPU machine's torch, then bench_step on every local GPU
# for this tree and, when given, another checkout of the project (the code before a change),
# one after the other on the same machine.
#
#   bash benchmarks/gpu_check.sh [OTHER_TREE]      # on the GPU machine, from the repo root
#
# Environment: TESTS (test files), METHODS, PLAN, ROUNDS (bench_step's), TEST_TIMEOUT and
# BENCH_TIMEOUT (seconds for each program).
#
# Needs the Hydra wheels in .whl/ (carry it); writes logs and bench JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
. "$(dirname "$0")/gpu_env.sh"
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $GPUS, torch $(python3 -c 'import torch; print(torch.__version__)')"
PYTHONPATH=/tmp/site:$PWD timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
  ${TESTS:-tests/test_graphs.py tests/test_gpu.py tests/test_copy_engine.py tests/test_compile.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
bench() {  # tree, name
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD timeout "${BENCH_TIMEOUT:-150}" torchrun --nproc_per_node "$GPUS" \
    benchmarks/bench_step.py --methods ${METHODS:-floor_graph gtp gtp_graph} \
    --plan "${PLAN:-125M:1;1.36B:1}" --fused-adamw --rounds ${ROUNDS:-2} --out "$OUT/bench_$2" 2>&1 \
    | grep -v Warning | tail -12)
}
bench . new
if [ -n "${1:-}" ]; then bench "$1" old; fi
