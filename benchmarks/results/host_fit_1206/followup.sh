# The three commands run on the same warm H100 after gpu.sh (2026-12-06 22:38-22:41 UTC): gpu.sh's
# 1.36B batch-1 run of four methods in one process ran out of the H100's 80 GB (paired_1.36B_b1.log),
# so its methods ran two at a time; then the eager comparison once more.
. benchmarks/gpu_env.sh >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
timeout 110 python3 benchmarks/paired_steps.py --model 1.36B --batch 1 --fused-adamw --cycles 20 \
  --methods gtp fsdp2 --out $OUT/paired_1.36B_b1_gtp_fsdp2.json > $OUT/paired_1.36B_b1_gtp_fsdp2.log 2>&1
timeout 80 python3 benchmarks/paired_steps.py --model 1.36B --batch 1 --fused-adamw --cycles 20 \
  --methods floor gtp_blocks --out $OUT/paired_1.36B_b1_floor_blocks.json \
  > $OUT/paired_1.36B_b1_floor_blocks.log 2>&1
timeout 95 python3 benchmarks/paired_steps.py --model 125M --batch 1 --fused-adamw --cycles 150 \
  --methods floor gtp_blocks --baseline .old --out $OUT/eager_base_b.json > $OUT/eager_base_b.log 2>&1
