# Issue 21, one H200, world 1: wall time and the process's CPU time per step (step_phases.py's
# step_cpu) and per weight use (host_overhead.py's per_use_cpu_us), run twice in one call to
# see which moves with the host. `bash gpu.sh A` writes phases_A.*, host_overhead_A.*;
# `bash gpu.sh tests` runs the CUDA tests instead.
. benchmarks/gpu_env.sh >/dev/null
S=${1:-a}
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$S" = tests ]; then
  PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_gpu.py tests/test_compile.py -k "cuda or graph or gpu or group_of_one or cast_by_one or shared_by or outside_it" > $OUT/cuda_tests.log 2>&1
  echo tests rc=$?; grep -E "passed|failed|error" $OUT/cuda_tests.log | tail -3; grep -E "^FAILED|^ERROR" $OUT/cuda_tests.log | head
  exit 0
fi
SP="benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw --rounds 8"
M="floor amp gtp_blocks floor_compile amp_compile gtp_compile"
PYTHONPATH=/tmp/site:$PWD timeout 300 torchrun --nproc_per_node 1 $SP --methods $M --out $OUT/phases_$S.json > $OUT/phases_$S.log 2>&1
echo phases rc=$?; grep "^| \(step\|step_cpu\|forward\|backward\|optimizer\|zero_grad\) \|ms per" $OUT/phases_$S.log
for i in 1 2; do
  PYTHONPATH=/tmp/site:$PWD timeout 90 python3 benchmarks/host_overhead.py --device cuda --steps 100 --rounds 7 --out $OUT/host_overhead_${S}$i.json > $OUT/host_overhead_${S}$i.log 2>&1
  echo host rc=$?; tail -3 $OUT/host_overhead_${S}$i.log
done
