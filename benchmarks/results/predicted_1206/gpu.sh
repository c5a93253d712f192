# Issue 26, one H100 (2026-12-06): the runs of h100_1206's call a, predicted first by the model
# whose GEMMs and attention are fitted to a step's kernels (predicted.json, made here and
# committed before the call by `python benchmarks/results/h100_1206/predict_first.py h100
# benchmarks/results/predicted_1206/predicted.json`), then calibrate.py's host time per layer
# three times (its two models' steps now timed in turn). About 6 minutes.
#   bash benchmarks/results/predicted_1206/gpu.sh
# Then, here: python benchmarks/results/predicted_1206/add_runs.py
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
phases() {  # name timeout rounds model batch methods... (extra flags in $X)
  local name=$1 limit=$2 rounds=$3 model=$4 batch=$5; shift 5
  timeout $limit python3 benchmarks/step_phases.py --model $model --batch $batch --fused-adamw \
    --rounds $rounds --warmup 3 --steps 10 --methods "$@" $X --out $OUT/$name.json \
    > $OUT/$name.log 2>&1
  echo $name rc=$?; grep "^| \(ms per\|step\) " $OUT/$name.log; grep "host_probe" $OUT/$name.log
}
phases phases_w1_125M_b1 100 4 125M 1 floor gtp_blocks gtp fsdp2
phases phases_w1_125M_b8 80 2 125M 8 floor gtp_blocks gtp
phases phases_w1_1.36B_b4 100 2 1.36B 4 floor gtp_blocks
X="--fake-world 2" phases phases_f2_125M_b1 120 3 125M 1 floor gtp_blocks gtp fsdp2
for i in 1 2 3; do  # stdout only: this call's readings are in host_layer_us.txt
  timeout 90 python3 -c '
import sys, torch; sys.path.insert(0, "benchmarks")
import calibrate
from gtp_wrap.scaling.model import MODELS
device = torch.device("cuda", 0)
loop = calibrate._gemm_loop(device, torch.bfloat16)
us, share = calibrate.host_layer_us(MODELS["gpt_1p36b"], device, torch.bfloat16, loop)
print(f"host_layer_us {us:.1f} (graphed share {share:.2f})")' 2>&1 | tail -1
done
