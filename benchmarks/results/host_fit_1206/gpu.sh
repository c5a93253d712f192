# Issues 21 and 26, one GPU (2026-12-06), first of two calls (about 8 minutes):
# 1. issue 21: 125M batch-1 eager steps of this tree against the tree before interception
#    stayed off through zero_grad (.old/: `git archive a93aba3 gtp_wrap`), in the same cycles;
# 2. issue 26: a calibration whose host times per use and per FSDP2 group are fitted to paired
#    gtp and fsdp2 steps, and the predictions of gpu2.sh's runs made from it before they run.
#   bash benchmarks/results/host_fit_1206/gpu.sh      (carry .whl and .old)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo $GPU
K=h100; [[ $GPU == *H200* ]] && K=h200
timeout 200 python3 benchmarks/paired_steps.py --model 125M --batch 1 --fused-adamw \
  --cycles 300 --methods floor gtp_blocks gtp --baseline .old --out $OUT/eager_base_a.json \
  > $OUT/eager_base_a.log 2>&1
echo "eager_base_a rc=$?"; tail -9 $OUT/eager_base_a.log
timeout 330 python3 benchmarks/calibrate.py --name $K --model gpt_1p36b --batches 1 8 \
  --budget-s 250 --out $OUT/${K}_calibrated.json > $OUT/calibrate.log 2>&1
echo "calibrate rc=$?"; tail -4 $OUT/calibrate.log
python3 benchmarks/results/paired_1206/predict_first.py $OUT/${K}_calibrated.json \
  $OUT/predicted.json floor,gtp_blocks,gtp,fsdp2
