# Issues 21 and 26, one H100 (2026-12-06). Call a (about 8 minutes):
#   bash benchmarks/results/h100_1206/gpu.sh a
# calibrate.py with its graphed per-layer fit, built into benchmarks/calibration/h100.json with
# the 12-05 call's runs held out; predict_first.py then predicts the step_phases runs below,
# before they run; the 125M batch-1 runs also time each method with its backward on the
# calling thread (--one-thread). Everything lands in $OUT; h100.json and predicted.json too.
# On an H200 the calibration is the committed h200.json: no calibrate.py, the rest the same.
# Call b (about 6 minutes): host_overhead.py per use at worlds 1 and faked 2, with autograd's
# device thread and without it (--one-thread), twice each, the order reversed the second time
# (as run on 12-06, both times device thread first).
# Call c (about 2 minutes): step_phases.py --one-thread at 125M batch 1, world 1 (10 rounds) and
# a faked world of two (6 rounds), each method beside itself with backward on the calling
# thread (as run on 12-06, every round in the same order; step_phases now reverses every other).
# Call d (about 2 minutes; on an H200, that GPU's; not run yet): calibrate.py again, its HBM
# rate the slope between two sizes and its host time per layer the slope between two depths
# (each alone held a step's fixed host costs), outputs in d.tgz. Then, here, on an H100's:
#   python benchmarks/calibration/scripts/h100_from_calibrate.py h100_calibrated_d.json \
#     benchmarks/results/h100_1206/h100_calibrated.json benchmarks/results/h100_1205/h100_calibrated.json
#   python benchmarks/results/h100_1206/add_runs.py && gtp-plan validate --cluster h100
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo $GPU
phases() {  # name timeout rounds model batch methods... (extra flags in $X)
  local name=$1 limit=$2 rounds=$3 model=$4 batch=$5; shift 5
  timeout $limit python3 benchmarks/step_phases.py --model $model --batch $batch --fused-adamw \
    --rounds $rounds --warmup 3 --steps 10 --methods "$@" $X --out $OUT/$name.json \
    > $OUT/$name.log 2>&1
  echo $name rc=$?; grep "^| \(ms per\|step\|backward\) " $OUT/$name.log
  grep "host_probe\|rounds_ms" $OUT/$name.log
}
case ${1:-a} in
  a)
    CLUSTER=h200
    if [[ $GPU == *H100* ]]; then
      CLUSTER=h100
      ( time timeout 300 python3 benchmarks/calibrate.py --name h100 --model gpt_1p36b \
          --batches 1 8 --budget-s 240 --out $OUT/h100_calibrated.json ) > $OUT/calibrate.log 2>&1
      echo calibrate rc=$?; tail -4 $OUT/calibrate.log
      python3 benchmarks/calibration/scripts/h100_from_calibrate.py $OUT/h100_calibrated.json \
        benchmarks/results/h100_1205/h100_calibrated.json || exit 1
      cp benchmarks/calibration/h100.json $OUT/
    fi
    python3 benchmarks/results/h100_1206/predict_first.py $CLUSTER $OUT/predicted.json || exit 1
    python3 -m gtp_wrap.scaling.cli validate --cluster $CLUSTER > $OUT/validate.txt 2>&1
    tail -1 $OUT/validate.txt
    X=--one-thread phases phases_w1_125M_b1 100 4 125M 1 floor gtp_blocks gtp fsdp2
    phases phases_w1_125M_b8 80 2 125M 8 floor gtp_blocks gtp
    phases phases_w1_1.36B_b4 100 2 1.36B 4 floor gtp_blocks
    X="--fake-world 2" phases phases_f2_125M_b1 120 3 125M 1 floor gtp_blocks gtp fsdp2 ;;
  c)
    X=--one-thread phases phases_1t_w1_125M_b1 200 10 125M 1 floor amp gtp_blocks gtp
    X="--one-thread --fake-world 2" phases phases_1t_f2_125M_b1 200 6 125M 1 floor gtp_blocks fsdp2 ;;
  d)
    K=h100; [[ $GPU == *H200* ]] && K=h200
    ( time timeout 300 python3 benchmarks/calibrate.py --name $K --model gpt_1p36b \
        --batches 1 8 --budget-s 240 --out $OUT/${K}_calibrated_d.json ) > $OUT/calibrate_d.log 2>&1
    echo calibrate rc=$?; tail -4 $OUT/calibrate_d.log
    python3 -c 'import json, sys; c = json.load(open(sys.argv[1]))["compute"]; print(c["hbm_gbs"])' \
      $OUT/${K}_calibrated_d.json
    (cd $OUT && tar czf d.tgz ${K}_calibrated_d.json calibrate_d.log) ;;
  b)
    for i in 1 2; do
      modes="threads one_thread"; [ $i = 2 ] && modes="one_thread threads"
      for mode in $modes; do
        flag=; [ $mode = one_thread ] && flag=--one-thread
        timeout 170 python3 benchmarks/host_overhead.py --device cuda --steps 100 --rounds 7 \
          $flag --out $OUT/host_overhead_${mode}_$i.json > $OUT/host_overhead_${mode}_$i.log 2>&1
        echo host_overhead $mode $i rc=$?; tail -3 $OUT/host_overhead_${mode}_$i.log
      done
    done ;;
esac
