# Issue 26, one GPU (2026-12-06): GEMMs on inputs in L2 and not, and a floor step's GEMMs by
# shape and its attention. About 2-3 minutes on an H100 or H200.
#   bash benchmarks/results/gemm_l2_1206/gpu.sh          (both)
#   bash benchmarks/results/gemm_l2_1206/gpu.sh instep   (the step's kernels only)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo $GPU
K=h100; [[ $GPU == *H200* ]] && K=h200
D=benchmarks/results/gemm_l2_1206
[ "$1" = instep ] || timeout 300 python3 $D/cold_parts.py $OUT/${K}_cold_parts.json 2>&1 | tail -30
timeout 240 torchrun --nproc_per_node 1 $D/instep_shapes.py $OUT/${K}_instep.json 2>&1 | tail -8
# Then a calibration whose GEMM and attention rates come from the plain step's kernels:
#   bash benchmarks/results/gemm_l2_1206/gpu.sh instep cal
if [ "$2" = cal ]; then
  timeout 320 python3 benchmarks/calibrate.py --name $K --model gpt_1p36b --batches 1 8 \
    --out $OUT/${K}_calibrated_instep.json 2>&1 | tail -15
fi
