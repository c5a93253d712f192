# One GPU, one call of about 8 minutes: the 1.36B steps paired on this tree (decompose_1207/gpu3.sh,
# not run last session: issue 21's <= 1.05 x floor at batch 8, and batch 1), then the CUDA tests
# of the tree whose MoE-compile, fp8 warning and README fixes had not met CUDA.
#   bash benchmarks/results/gpu_1207b/gpu.sh      (carry .whl)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
bash benchmarks/results/decompose_1207/gpu3.sh
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_gpu.py \
  tests/test_compile.py tests/test_hooks.py > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/cuda_tests.log
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_moe.py tests/test_muon.py \
  tests/test_nvfp4.py tests/test_meta_init.py > $OUT/cuda_marked.log 2>&1
echo "gpu-marked rc=$?"; tail -3 $OUT/cuda_marked.log
