# Sourced by the GPU-machine scripts: NVLink multicast off (it can take the host's GPUs down),
# unbuffered output, $OUT made, and the Hydra wheels from .whl/ installed into /tmp/site.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
# The package itself too: policy files name built-in defaults by package (gtp_wrap.configs),
# which only an install maps from configs/.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
  || echo "gpu_env: gtp_wrap not installed; policies with built-in defaults will not load"
