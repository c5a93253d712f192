. benchmarks/gpu_env.sh >/dev/null
PYTHONPATH=/tmp/site:$PWD timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_gpu.py tests/test_compile.py -k "cuda or graph or gpu or group_of_one or cast_by_one or shared_by or outside_it" > $OUT/cuda_tests.log 2>&1
echo tests rc=$?; grep -E "passed|failed|error" $OUT/cuda_tests.log | tail -5; grep -E "^FAILED|^ERROR" $OUT/cuda_tests.log | head
