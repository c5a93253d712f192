# Issue 21, one GPU, about 4 minutes: after gpu.sh put gtp_blocks 1.17 x above floor_per_param
# (the engine's share alone) and the optimizer's subclass check at 49 us a step, where the
# engine's 3 ms at 125M batch 1 goes on this tree: floor_per_param and gtp_blocks profiled
# (torch.profiler's ops table and a cProfile, backward on the calling thread), then the engine's
# host time per weight use (host_overhead.py, the 30 us target).
#   bash benchmarks/results/decompose_1207/gpu2.sh      (carry .whl)
METHODS="floor_per_param gtp_blocks" bash benchmarks/results/paired_1206/gpu3.sh
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 170 python3 benchmarks/host_overhead.py --device cuda --steps 100 --rounds 7 \
  --out $OUT/host_overhead.json > $OUT/host_overhead.log 2>&1
echo "host_overhead rc=$?"; tail -12 $OUT/host_overhead.log
