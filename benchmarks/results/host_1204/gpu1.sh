# Issue 21, ninth step, one H200: this tree against its parent 7005989 (.whl/base, `git archive 7005989 gtp_wrap`)
# interleaved in one process, in both orders; the per-use host time; the CUDA tests. `bash gpu1.sh 2`
# names its outputs phases2_*, host_overhead2_* (the second call, 15:08).
. benchmarks/gpu_env.sh >/dev/null
S=${1:-}
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf .whl/new && mkdir -p .whl/new && cp -r gtp_wrap .whl/new/
SP="benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw --rounds 10"
M="floor amp gtp_blocks amp_compile gtp_compile"
PYTHONPATH=/tmp/site:$PWD timeout 170 torchrun --nproc_per_node 1 $SP --methods $M --baseline .whl/base --out $OUT/phases${S}_tree_first.json > $OUT/phases${S}_tree_first.log 2>&1
echo tree-first rc=$?; grep "^| \(step\|forward\|backward\|optimizer\|zero_grad\) \|ms per" $OUT/phases${S}_tree_first.log
PYTHONPATH=/tmp/site:$PWD/.whl/base timeout 170 torchrun --nproc_per_node 1 $SP --methods $M --baseline .whl/new --out $OUT/phases${S}_parent_first.json > $OUT/phases${S}_parent_first.log 2>&1
echo parent-first rc=$?; grep "^| \(step\|forward\|backward\|optimizer\|zero_grad\) \|ms per" $OUT/phases${S}_parent_first.log
grep -o '"packages": {[^}]*}' $OUT/phases${S}_parent_first.json
PYTHONPATH=/tmp/site:$PWD timeout 60 python3 benchmarks/host_overhead.py --device cuda --steps 100 --rounds 7 --out $OUT/host_overhead${S}_cuda.json > $OUT/host_overhead.log 2>&1
echo host rc=$?; tail -4 $OUT/host_overhead.log
PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_gpu.py tests/test_compile.py -k "cuda or graph or gpu or group_of_one or cast_by_one or shared_by or outside_it" > $OUT/cuda_tests.log 2>&1
echo tests rc=$?; grep -E "passed|failed|error" $OUT/cuda_tests.log | tail -3; grep -E "^FAILED|^ERROR" $OUT/cuda_tests.log | head
