"""A gloo DeviceMesh alive past dist.destroy_process_group aborts its process at exit, without
gtp_wrap (torch 2.13, CPU): "terminate called without an active exception", SIGABRT, in 5 of
10 runs on 2 ranks; with `delmesh` (the mesh dropped before the interpreter exits) 0 of 10.

    for i in $(seq 10); do torchrun --nproc_per_node 2 mesh_at_exit.py [delmesh]; done
"""

import sys, weakref, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("gtp",))
held_w = weakref.ref(mesh.get_group("gtp"))
for i in range(20):
    x = torch.randn(16)
    dist.all_reduce(x, group=held_w())
dist.destroy_process_group()
print("after destroy, group alive:", held_w() is not None, flush=True)
if "delmesh" in sys.argv:
    del mesh
    print("after del mesh, group alive:", held_w() is not None, flush=True)
