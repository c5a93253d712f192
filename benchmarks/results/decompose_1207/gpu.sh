# Issue 21, one GPU, one call of about 7 minutes: where gtp_blocks' step at 125M batch 1 spends
# what the floor's does not. floor_per_param is the floor with its AdamW over one tensor per
# parameter, as GTP's shards are, so gtp_blocks / floor_per_param is the engine's share alone.
# Then the compiled steps of this tree, and the CUDA tests.
#   bash benchmarks/results/decompose_1207/gpu.sh      (carry .whl)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
paired() {  # name timeout model batch cycles methods...
  local name=$1 limit=$2 model=$3 batch=$4 cycles=$5; shift 5
  timeout $limit python3 benchmarks/paired_steps.py --model $model --batch $batch --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$?"; tail -7 $OUT/$name.log
}
paired eager 110 125M 1 200 floor floor_per_param gtp_blocks amp
paired compiled 240 125M 1 150 floor_compile gtp_compile amp_compile
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_gpu.py \
  tests/test_compile.py > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc=$?"; tail -3 $OUT/cuda_tests.log
