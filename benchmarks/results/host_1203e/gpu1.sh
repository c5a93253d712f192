. benchmarks/gpu_env.sh >/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT timeout 420 python3 .whl/prof_compile.py cuda 125M floor,amp,gtp_blocks,floor_compile,amp_compile,gtp_compile > $OUT/prof.txt 2>&1
echo prof rc=$?
grep -v "^ " $OUT/prof.txt | tail -20
