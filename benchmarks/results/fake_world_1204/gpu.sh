# Issue 21, one H200: the host side of a two-GPU step, the world of two faked
# (step_phases.py --fake-world 2: every collective returns at once; the peer rank wraps and
# warms up on CPU). `bash gpu.sh A` writes phases_A_<model>.*; with BASE=<tree> each gtp
# method also runs on that tree's gtp_wrap, interleaved (--baseline).
. benchmarks/gpu_env.sh >/dev/null
S=${1:-a}
M=${M:-floor amp gtp_blocks gtp fsdp2}
nvidia-smi --query-gpu=name --format=csv,noheader
for spec in "125M 1 4" "1.36B 1 3"; do
  set -- $spec
  PYTHONPATH=/tmp/site:$PWD timeout 280 python3 benchmarks/step_phases.py --model $1 --batch $2 --fused-adamw --rounds $3 --warmup 3 --steps 10 --fake-world 2 --methods $M ${BASE:+--baseline $BASE} --out $OUT/phases_${S}_$1.json > $OUT/phases_${S}_$1.log 2>&1
  echo $1 rc=$?; grep "^| " $OUT/phases_${S}_$1.log; tail -3 $OUT/phases_${S}_$1.log | grep -v "^|"
done
