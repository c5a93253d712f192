# Issue 26, one GPU (2026-12-06): GEMMs on inputs in L2 and not, and a floor step's GEMMs by
# shape. About 2-3 minutes on an H100 or H200.
#   bash benchmarks/results/gemm_l2_1206/gpu.sh
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo $GPU
K=h100; [[ $GPU == *H200* ]] && K=h200
D=benchmarks/results/gemm_l2_1206
timeout 300 python3 $D/cold_parts.py $OUT/${K}_cold_parts.json 2>&1 | tail -30
timeout 240 torchrun --nproc_per_node 1 $D/instep_shapes.py $OUT/${K}_instep.json 2>&1 | tail -8
