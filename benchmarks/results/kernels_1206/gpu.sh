# Issue 26, one GPU (2026-12-06): the plain floor's device time by kernel kind, to check the
# cost model's parts (GEMMs, attention, the loss, elementwise work) one by one, at the two
# reference models and batch 1 and 8. profile_gtp.py's summaries (trace analysed, then
# deleted: tens of MB each), then the summaries' figures in one table.
#   bash benchmarks/results/kernels_1206/gpu.sh      (about 3 minutes; H100 or H200)
# Call b (about 1 minute): the parts one by one, as the model counts them (parts.py).
#   bash benchmarks/results/kernels_1206/gpu.sh b
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo $GPU
K=h100; [[ $GPU == *H200* ]] && K=h200
if [ "$1" = b ]; then
  timeout 300 python3 benchmarks/results/kernels_1206/parts.py $OUT/${K}_parts.json 2>&1 | tail -60
  exit
fi
for run in 125M:1 125M:8 1.36B:1 1.36B:8; do
  model=${run%:*} batch=${run#*:} name=${K}_floor_${model}_b${run#*:}
  timeout 120 torchrun --nproc_per_node 1 benchmarks/profile_gtp.py --model $model \
    --batch $batch --fused-adamw --steps 4 --method floor --out $OUT/$name > $OUT/$name.log 2>&1
  echo $name rc=$?
  rm -f $OUT/$name/trace_rank0.json $OUT/$name/ops_rank0.txt
  mv $OUT/$name/summary_rank0.json $OUT/$name.json && rmdir $OUT/$name
done
(cd $OUT && tar czf kernels.tgz ${K}_floor_*)
# Then, here: python benchmarks/results/kernels_1206/compare.py ${K}_parts.json $K and
# python benchmarks/results/kernels_1206/wave_fits.py ${K}_parts.json (as run on 12-06: an
# H200, compare_h200.txt, wave_fits_h200.txt).
# On an H100 the same at 04:47 (compare_h100.txt, wave_fits_h100.txt).
