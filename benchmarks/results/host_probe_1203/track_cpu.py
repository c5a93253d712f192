import sys, time, json, statistics
ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]; sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
import torch, torch.nn.functional as F
torch.set_num_threads(1)
from host_probe import HostProbe
from gtp_wrap.app.model import GPT, GPTConfig
dev = torch.device("cpu")
probe = HostProbe(dev)
torch.manual_seed(0)
cfg = GPTConfig(vocab=512, d=96, layers=12, heads=4, ffn=256, max_seq=64)
model = GPT(cfg)
opt = torch.optim.AdamW(model.parameters(), fused=False)
idx = torch.randint(0, 512, (1, 33), generator=torch.Generator().manual_seed(0))
def step():
    F.cross_entropy(model(idx[:, :-1]).float().flatten(0,1), idx[:, 1:].flatten()).backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(5): step()
label = sys.argv[1]
rows = []
for r in range(int(sys.argv[2])):
    a = probe()
    ts = []
    for _ in range(10):
        t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
    b = probe()
    rows.append((statistics.median(ts)*1e3, (a+b)/2))
st = statistics.median(r[0] for r in rows); pr = statistics.median(r[1] for r in rows)
print(json.dumps({"label": label, "step_ms": round(st,3), "probe_ms": round(pr,3), "ratio": round(st/pr,3)}))
