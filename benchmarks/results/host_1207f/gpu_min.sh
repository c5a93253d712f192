# The least that shows the two fixes on CUDA, for a short budget: the graphed-region tests, and
# the gpu-marked MoE tests that need the installed package (gtp_wrap.configs).
#   bash benchmarks/results/host_1207f/gpu_min.sh      (carry .whl)
. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py > $OUT/graphs.log 2>&1
echo "graphs rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/graphs.log | tail -6
timeout 50 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_moe.py > $OUT/moe.log 2>&1
echo "moe gpu rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/moe.log | tail -4
