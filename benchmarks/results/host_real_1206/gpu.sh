# Issue 21, one GPU (2026-12-06): where the real model's eager step spends the host time GTP
# adds. The cost model's held-out runs imply 150-300 µs per weight use in the GPT at batch 1
# (gtp against the floor, same call), against 36-58 µs per use for host_overhead.py's 16
# Linear(64, 64). profile_gtp.py --one-thread runs backward on the calling thread, so its
# cProfile sees it; one profile per method, then 10 interleaved rounds for paired ratios.
#   bash benchmarks/results/host_real_1206/gpu.sh      (call a, about 2 minutes)
# Call b (about 8 minutes): host_overhead.py per use, device thread then calling thread, and the
# compiled methods at 125M batch 1, interleaved, for issue 21's compiled ratio on this host.
#   bash benchmarks/results/host_real_1206/gpu.sh b
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if [ "$1" = b ]; then
  for mode in threads one_thread; do
    flag=; [ $mode = one_thread ] && flag=--one-thread
    timeout 170 python3 benchmarks/host_overhead.py --device cuda --steps 100 --rounds 7 \
      $flag --out $OUT/host_overhead_$mode.json > $OUT/host_overhead_$mode.log 2>&1
    echo host_overhead $mode rc=$?; tail -5 $OUT/host_overhead_$mode.log
  done
  timeout 250 python3 benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw \
    --rounds 6 --warmup 3 --steps 10 --methods floor_compile amp_compile gtp_compile \
    --out $OUT/phases_compile_125M_b1.json > $OUT/phases_compile_125M_b1.log 2>&1
  echo phases rc=$?; grep "^| \(ms per\|step\) \|rounds_ms" $OUT/phases_compile_125M_b1.log
  (cd $OUT && tar czf b.tgz host_overhead_* phases_compile_*)
  exit
fi
for m in floor gtp_blocks gtp; do
  timeout 150 torchrun --nproc_per_node 1 benchmarks/profile_gtp.py --model 125M --batch 1 \
    --fused-adamw --cprofile --one-thread --steps 10 --method $m --out $OUT/prof_$m \
    > $OUT/prof_$m.log 2>&1
  echo profile $m rc=$? $(grep '"step_ms"\|host_us_per' $OUT/prof_$m.log)
  rm -f $OUT/prof_$m/trace_rank0.json
done
timeout 200 python3 benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw --rounds 10 \
  --warmup 3 --steps 10 --methods floor gtp_blocks gtp --one-thread \
  --out $OUT/phases_125M_b1.json > $OUT/phases_125M_b1.log 2>&1
echo phases rc=$?; grep "^| \(ms per\|step\) \|rounds_ms" $OUT/phases_125M_b1.log
(cd $OUT && tar czf out.tgz prof_* phases_125M_b1.*)
