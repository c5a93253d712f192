# Issue 26, one GPU (2026-12-06): a calibration whose host time is fitted to paired host-bound
# steps (calibrate.py, [Note: the host's time, fitted to host-bound steps]), the predictions of
# the runs after it made from it (predict_first.py), then those runs, each taking turns with
# the host probe (paired_steps.py). About 8 minutes.
#   bash benchmarks/results/paired_1206/gpu2.sh
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
D=benchmarks/results/paired_1206
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo $GPU
K=h100; [[ $GPU == *H200* ]] && K=h200
timeout 330 python3 benchmarks/calibrate.py --name $K --model gpt_1p36b --batches 1 8 \
  --budget-s 250 --out $OUT/${K}_calibrated_paired.json > $OUT/calibrate.log 2>&1
echo "calibrate rc=$?"; tail -4 $OUT/calibrate.log
python3 $D/predict_first.py $OUT/${K}_calibrated_paired.json $OUT/predicted.json || exit 1
paired() {  # name timeout model batch cycles methods...
  local name=$1 limit=$2 model=$3 batch=$4 cycles=$5; shift 5
  timeout $limit python3 benchmarks/paired_steps.py --model $model --batch $batch --fused-adamw \
    --cycles $cycles --methods "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$?"; tail -7 $OUT/$name.log
}
paired paired_125M_b1 90 125M 1 150 floor gtp_blocks gtp fsdp2
paired paired_1.36B_b1 90 1.36B 1 40 floor gtp_blocks
paired paired_125M_b8 60 125M 8 30 floor gtp_blocks gtp
