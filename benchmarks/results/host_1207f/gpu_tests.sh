# The CUDA tests again after the graphed-region fix (regions give their shards to autograd.grad
# as gradient edges), with the package installed so the MoE tests load moe.yaml's defaults
# (test_compile, 89 s, passed at 22:41 on this tree but for the fix, is left out for time).
#   bash benchmarks/results/host_1207f/gpu_tests.sh      (carry .whl)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
python3 -c "import gtp_wrap, importlib.resources as r; print(gtp_wrap.__file__, r.files('gtp_wrap.configs'))"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_gpu.py tests/test_copy_engine.py \
  tests/test_hooks.py tests/test_access.py \
  > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_tests.log | tail -8
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_moe.py tests/test_muon.py \
  tests/test_nvfp4.py tests/test_meta_init.py tests/test_precision.py > $OUT/cuda_marked.log 2>&1
echo "gpu-marked rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_marked.log | tail -8
