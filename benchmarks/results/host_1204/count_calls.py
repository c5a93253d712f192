import sys, os, collections, gc
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch, torch.nn.functional as F
import torch.distributed as dist
from bench_step import _build, batch_of, clear_grads
from step_phases import MODELS
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29539")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
cfg = MODELS["tiny"]; dev = torch.device("cpu")
detail = os.environ.get("DETAIL")
for method in sys.argv[1].split(","):
    model, optim, autocast = _build(method, cfg, dev, 1, {}, False)
    idx = batch_of(cfg, 1, 16, dev); x, y = idx[:, :-1], idx[:, 1:]
    phase = ["fwd"]
    def step():
        phase[0] = "fwd"
        with torch.autocast("cpu", autocast, enabled=autocast is not None):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        phase[0] = "bwd"; loss.backward(); phase[0] = "opt"; optim.step(); phase[0] = "zero"; clear_grads(method, model, optim)
    for _ in range(6): step()
    counts = collections.Counter(); byfn = collections.Counter()
    def prof(frame, event, arg):
        if event == "call" or event == "c_call":
            counts[phase[0] + ":" + event] += 1
            if detail and event == "call":
                c = frame.f_code
                if "gtp_wrap" in c.co_filename: byfn[c.co_filename.split("gtp_wrap/")[-1] + ":" + c.co_name] += 1
    n = 4
    gc.disable(); sys.setprofile(prof)
    for _ in range(n): step()
    sys.setprofile(None); gc.enable()
    tot = {k: v / n for k, v in sorted(counts.items())}
    print(method, "py+c calls/step", sum(tot.values()), tot)
    if detail:
        for k, v in byfn.most_common(40): print(f"   {v/n:6.1f} {k}")
