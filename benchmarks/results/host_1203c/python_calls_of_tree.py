import sys, os, torch
tree = sys.argv[1]
sys.path.insert(0, tree + "/benchmarks")
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
H = __import__(sys.argv[3])
import gtp_wrap; assert gtp_wrap.__file__.startswith(tree), gtp_wrap.__file__
torch.set_num_threads(1)
for block in (0, 4):
    for pol, policy in H.POLICIES.items():
        dtype = torch.bfloat16 if "param_dtype" in policy else torch.float32
        x = torch.randn(4, 64)
        g = H._python_calls_per_step(H._wrap(H._model(16, 64, False, block, "cpu"), policy, block), x)
        p = H._python_calls_per_step(H._model(16, 64, False, block, "cpu").to(dtype), x.to(dtype))
        print(f"{os.path.basename(tree)} block {block} {pol}: {(g - p) / 32:.2f} extra Python calls per use")
