# Issue 21, ninth step, one H200: the session's final engine against 7005989 (.whl/base) in one
# process, every eager and compiled method beside its reference; per-use host time twice; the CUDA tests.
. benchmarks/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
SP="benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw --rounds 10"
M="floor floor_compile amp amp_compile gtp gtp_blocks gtp_compile"
PYTHONPATH=/tmp/site:$PWD timeout 280 torchrun --nproc_per_node 1 $SP --methods $M --baseline .whl/base --out $OUT/phases3.json > $OUT/phases3.log 2>&1
echo phases rc=$?; grep "^| \(step\|forward\|backward\|optimizer\|zero_grad\) \|ms per" $OUT/phases3.log
for i in 1 2; do
PYTHONPATH=/tmp/site:$PWD timeout 60 python3 benchmarks/host_overhead.py --device cuda --steps 100 --rounds 7 --out $OUT/host_overhead3_$i.json > $OUT/host_overhead3.log 2>&1
echo host rc=$?; tail -2 $OUT/host_overhead3.log
done
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_gpu.py tests/test_compile.py -k "cuda or graph or gpu or group_of_one or cast_by_one or shared_by or outside_it" > $OUT/cuda_tests3.log 2>&1
echo tests rc=$?; grep -E "passed|failed|error" $OUT/cuda_tests3.log | tail -3; grep -E "^FAILED|^ERROR" $OUT/cuda_tests3.log | head
