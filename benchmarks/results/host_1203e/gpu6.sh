. benchmarks/gpu_env.sh >/dev/null
PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_gpu.py tests/test_compile.py -k "cuda or graph or gpu" > $OUT/cuda_tests.log 2>&1
echo tests rc=$?; grep -E "passed|failed|error" $OUT/cuda_tests.log | tail -3; grep -E "^FAILED|^ERROR" $OUT/cuda_tests.log | head
