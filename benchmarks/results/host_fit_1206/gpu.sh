# Issues 21 and 26, one GPU (2026-12-06), one call of about 6 minutes:
# 1. issue 21: 125M batch-1 eager steps of this tree against the tree before interception
#    stayed off through zero_grad (.old/: `git archive a93aba3 gtp_wrap`), in the same cycles;
# 2. issue 26: a calibration whose host times per use and per FSDP2 group are fitted to paired
#    gtp and fsdp2 steps, the predictions of the runs after it made from it before they run
#    (predict_first.py), then those runs, each taking turns with the host probe.
#   bash benchmarks/results/host_fit_1206/gpu.sh      (carry .whl and .old)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo $GPU
K=h100; [[ $GPU == *H200* ]] && K=h200
paired() {  # name timeout model batch cycles methods... [--baseline TREE]
  local name=$1 limit=$2 model=$3 batch=$4 cycles=$5; shift 5
  timeout $limit python3 benchmarks/paired_steps.py --model $model --batch $batch --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$?"; tail -9 $OUT/$name.log
}
paired eager_base_a 100 125M 1 150 floor gtp_blocks gtp --baseline .old
timeout 190 python3 benchmarks/calibrate.py --name $K --model gpt_1p36b --batches 1 8 \
  --budget-s 120 --out $OUT/${K}_calibrated.json > $OUT/calibrate.log 2>&1
echo "calibrate rc=$?"; tail -4 $OUT/calibrate.log
python3 benchmarks/results/paired_1206/predict_first.py $OUT/${K}_calibrated.json \
  $OUT/predicted.json floor,gtp_blocks,gtp,fsdp2 || echo "no predictions: the runs are held out"
paired paired_1.36B_b1 75 1.36B 1 25 floor gtp_blocks gtp fsdp2
paired paired_125M_b8 45 125M 8 25 floor gtp_blocks gtp fsdp2
