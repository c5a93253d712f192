# Where only an H100 comes (one GPU): the CUDA tests of this session's tree (the replicated
# all-reduce group, the copy-engine axis guard and the autograd.grad refusal touch engine and
# comm code), then the 125M batch-1 eager and compiled ratios.
#   bash benchmarks/results/host_1207e/gpu_h100.sh      (carry .whl)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_gpu.py \
  tests/test_compile.py tests/test_copy_engine.py tests/test_hooks.py tests/test_access.py \
  > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc=$?"; grep -E "passed|failed|Error" $OUT/cuda_tests.log | tail -6
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_moe.py tests/test_muon.py \
  tests/test_nvfp4.py tests/test_meta_init.py > $OUT/cuda_marked.log 2>&1
echo "gpu-marked rc=$?"; tail -2 $OUT/cuda_marked.log
for run in "eager 80 120 floor floor_per_param gtp_blocks amp" \
           "compiled 110 100 floor_compile gtp_compile amp_compile"; do
  set -- $run
  name=$1 limit=$2 cycles=$3; shift 3
  timeout $limit python3 benchmarks/paired_steps.py --model 125M --batch 1 --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$?"; tail -6 $OUT/$name.log
done
