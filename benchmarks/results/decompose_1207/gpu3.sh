# Issue 21, one GPU, about 3 minutes: the 1.36B targets on this tree, paired (floor and
# gtp_blocks take turns a step at a time; two 1.36B models with AdamW state fit in 80 GB, four
# did not): batch 8 (issue 21: gtp <= 1.05 x floor) and batch 1. The runs go to h100.json held
# out (benchmarks/stored_runs.py h100 ...).
#   bash benchmarks/results/decompose_1207/gpu3.sh      (carry .whl)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
for run in "b8 8 150 30" "b1 1 120 80"; do
  set -- $run
  timeout $3 python3 benchmarks/paired_steps.py --model 1.36B --batch $2 --fused-adamw \
    --cycles $4 --methods floor gtp_blocks --out $OUT/paired_1.36B_$1.json > $OUT/paired_1.36B_$1.log 2>&1
  echo "1.36B $1 rc=$?"; tail -5 $OUT/paired_1.36B_$1.log
done
