# Issue 21, one H200: the host side of a two-GPU step in a faked world of two, the calls that
# follow the 2026-12-04 one (../fake_world_1204). Each call fits the 600 s limit:
#   M=... BASE=.whl/base bash gpu.sh b 125M   # this tree against BASE's gtp_wrap, interleaved
#   bash gpu.sh c                               # 125M: eager at batch 4 and 8
#   bash gpu.sh d                               # 125M: compiled at batch 1
#   bash gpu.sh e                               # host_overhead: per use, worlds 1 and faked 2
#   bash gpu.sh tests                           # the CUDA tests on this tree
# By value, for a session's 30 minutes: `bash gpu.sh tests; bash gpu.sh e` in one call (short),
# then b 125M, d, c, b 1.36B. At 1.36B each method's model and AdamW state take 12-22 GB on
# rank 0 (about 80 GB for the five of the 2026-12-04 call, run on an H200): on an 80 GB H100,
# give b 1.36B with BASE fewer methods, M="floor gtp_blocks".
# BASE: a tree holding another commit's gtp_wrap/ (`git archive REV gtp_wrap | tar -x -C
# .whl/base`), carried with `.whl`. Outputs: phases_<call>_<model>_b<batch>.{json,log}.
. benchmarks/gpu_env.sh >/dev/null
S=${1:-b}
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # model batch rounds methods...
  local model=$1 batch=$2 rounds=$3; shift 3
  local name=phases_${S}_${model}_b${batch}
  PYTHONPATH=/tmp/site:$PWD timeout 280 python3 benchmarks/step_phases.py --model $model \
    --batch $batch --fused-adamw --rounds $rounds --warmup 3 --steps 10 --fake-world 2 \
    --methods "$@" ${BASE:+--baseline $BASE} --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo $name rc=$?; grep "^| \(ms per\|step\|forward\|backward\|optimizer\) " $OUT/$name.log
  grep host_probe_ms $OUT/$name.log
}
case $S in
  b) run ${2:-125M} 1 3 ${M:-floor gtp_blocks gtp fsdp2} ;;
  c) run 125M 4 3 floor gtp_blocks fsdp2
     run 125M 8 2 floor gtp_blocks fsdp2 ;;
  d) run 125M 1 3 floor_compile gtp_compile fsdp2_compile ;;
  e) for i in 1 2; do
       PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/host_overhead.py --device cuda \
         --steps 100 --rounds 7 --out $OUT/host_overhead_e$i.json > $OUT/host_overhead_e$i.log 2>&1
       echo host rc=$?; tail -3 $OUT/host_overhead_e$i.log
     done ;;
  tests)
    PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider \
      tests/test_graphs.py tests/test_gpu.py tests/test_compile.py \
      -k "cuda or graph or gpu or group_of_one or cast_by_one or shared_by or outside_it" \
      > $OUT/cuda_tests.log 2>&1
    echo tests rc=$?; grep -E "passed|failed|error" $OUT/cuda_tests.log | tail -3
    grep -E "^FAILED|^ERROR" $OUT/cuda_tests.log | head ;;
esac
