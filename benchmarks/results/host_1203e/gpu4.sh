. benchmarks/gpu_env.sh >/dev/null
SP="benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw --rounds 10"
PYTHONPATH=/tmp/site:$PWD timeout 200 torchrun --nproc_per_node 1 $SP --methods floor amp gtp_blocks floor_compile amp_compile gtp_compile --out $OUT/phases_amp_r10.json > $OUT/phases_amp.log 2>&1
echo amp rc=$?; grep "^| \(step\|forward\|backward\|optimizer\|zero_grad\) \|ms per" $OUT/phases_amp.log
# the order swapped: the parent as main, this tree as the baseline
PYTHONPATH=/tmp/site:$PWD/.whl/base3 timeout 170 torchrun --nproc_per_node 1 $SP --methods floor gtp_blocks floor_compile gtp_compile --baseline .whl/new3 --out $OUT/phases_swapped_r10.json > $OUT/phases_swapped.log 2>&1
echo swapped rc=$?; grep "^| \(step\|forward\|backward\|optimizer\) \|ms per" $OUT/phases_swapped.log; grep -o '"packages": {[^}]*}' $OUT/phases_swapped_r10.json
PYTHONPATH=/tmp/site:$PWD timeout 170 python3 -m pytest -q -p no:cacheprovider -x tests/test_compile.py tests/test_graphs.py tests/test_gpu.py > $OUT/cuda_tests.log 2>&1
echo tests rc=$?; tail -3 $OUT/cuda_tests.log
