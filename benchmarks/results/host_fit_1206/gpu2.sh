# Issues 26 and 21, one GPU (2026-12-06), second of two calls (about 5 minutes): the runs
# gpu.sh's calibration predicted (predicted.json, from its call, copied here), each taking
# turns with the host probe, then the eager comparison with the tree before once more.
#   bash benchmarks/results/host_fit_1206/gpu2.sh     (carry .whl and .old)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
paired() {  # name timeout model batch cycles methods...
  local name=$1 limit=$2 model=$3 batch=$4 cycles=$5; shift 5
  timeout $limit python3 benchmarks/paired_steps.py --model $model --batch $batch --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$?"; tail -8 $OUT/$name.log
}
paired paired_125M_b1 90 125M 1 150 floor gtp_blocks gtp fsdp2
paired paired_1.36B_b1 100 1.36B 1 40 floor gtp_blocks gtp fsdp2
paired paired_125M_b8 80 125M 8 30 floor gtp_blocks gtp fsdp2
paired eager_base_b 200 125M 1 300 floor gtp_blocks gtp --baseline .old
