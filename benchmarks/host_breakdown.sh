#!/usr/bin/env bash
# One device call: where the host time of an eager step goes, per method, on one GPU (world 1):
# bench_step's step times side by side, then profile_gtp.py's torch.profiler op table and
# cProfile per method, and host_overhead.py's per-use cost on the GPU host.
#
#   bash benchmarks/host_breakdown.sh [OTHER_TREE]   # on the GPU machine, from the repo root
#
# With OTHER_TREE (another checkout: the code before a change), its bench_step runs right after
# this tree's, on the same host, and its host_overhead.py after this tree's.
#
# Environment: METHODS (default: floor gtp gtp_blocks floor_compile gtp_compile), MODEL (125M),
# BATCH (1). Needs the Hydra wheels in .whl/ (carry it); writes everything into
# $OUT/host_breakdown.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/host_breakdown}
. "$(dirname "$0")/gpu_env.sh"
METHODS=${METHODS:-floor gtp gtp_blocks floor_compile gtp_compile}
MODEL=${MODEL:-125M}
BATCH=${BATCH:-1}
bench() {  # tree, name
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD timeout 200 torchrun --nproc_per_node 1 \
    benchmarks/bench_step.py --methods $METHODS --plan "$MODEL:$BATCH" --fused-adamw --rounds 2 \
    --out "$OUT/bench_$2" 2>&1 | grep -v Warning | tail -8)
}
bench . new
if [ -n "${1:-}" ]; then bench "$1" old; fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
for m in ${PROFILE_METHODS:-gtp_blocks gtp}; do
  timeout 120 torchrun --nproc_per_node 1 benchmarks/profile_gtp.py --model "$MODEL" \
    --batch "$BATCH" --method "$m" --fused-adamw --cprofile --out "$OUT/prof_$m" 2>&1 \
    | grep -v Warning | tail -2
  echo "== $m: ops"; head -30 "$OUT/prof_$m/ops_rank0.txt"
  echo "== $m: cProfile"; sed -n 1,45p "$OUT/prof_$m/cprofile_rank0.txt"
done
overhead() {  # tree, name
  for block in 0 4; do
    (cd "$1" && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/host_overhead.py \
      --device cuda --block $block --out "$OUT/host_overhead_$2_block$block.json" 2>&1 | tail -3)
  done
}
overhead . new
if [ -n "${1:-}" ]; then overhead "$1" old; fi
# The device machine returns at most 8 files: everything comes back as one archive, without the
# Chrome traces (tens of MB each; profile_gtp.py writes one per method).
rm -f "$OUT"/prof_*/trace_rank0.json
tar czf /tmp/host_breakdown.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/host_breakdown.tgz "$OUT/"
