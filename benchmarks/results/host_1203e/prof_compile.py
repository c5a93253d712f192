import sys, os, time, collections, json
ROOT=os.getcwd(); sys.path.insert(0, ROOT+"/benchmarks"); sys.path.insert(0, ROOT)
import torch, torch.distributed as dist
import torch.nn.functional as F
os.environ.setdefault("MASTER_ADDR","127.0.0.1"); os.environ.setdefault("MASTER_PORT","29533")
dev = torch.device(sys.argv[1] if len(sys.argv)>1 else "cpu")
dist.init_process_group("gloo" if dev.type=="cpu" else "nccl", rank=0, world_size=1)
if dev.type=="cpu": torch.set_num_threads(1)
from bench_step import _build, MODELS, clear_grads
from gtp_wrap.app.model import GPTConfig
cfg = MODELS.get(sys.argv[2] if len(sys.argv)>2 else "x") or GPTConfig(vocab=512, d=128, layers=12, heads=4, ffn=344, max_seq=64)
seq = 2048 if dev.type=="cuda" else 32
methods = sys.argv[3].split(",") if len(sys.argv)>3 else ["floor_compile","gtp_compile"]
g = torch.Generator().manual_seed(0)
idx = torch.randint(0, cfg.vocab, (1, seq+1), generator=g).to(dev)
x, y = idx[:, :-1], idx[:, 1:]
res = {}
for m in methods:
    model, opt, ac = _build(m, cfg, dev, 1, {}, True)
    def step():
        with torch.autocast(dev.type, ac, enabled=ac is not None):
            loss = F.cross_entropy(model(x).float().flatten(0,1), y.flatten())
        loss.backward(); opt.step(); clear_grads(m, model, opt)
    for _ in range(8): step()
    if dev.type=="cuda": torch.cuda.synchronize()
    N=10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(N): step()
        if dev.type=="cuda": torch.cuda.synchronize()
    ev = collections.Counter(); cnt = collections.Counter()
    for e in prof.key_averages():
        ev[e.key] = e.self_cpu_time_total/N; cnt[e.key]=e.count/N
    res[m]=(ev,cnt)
    if dev.type=="cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof2:
            for _ in range(N):
                with torch.profiler.record_function("STEP"): step()
            torch.cuda.synchronize()
        evs = prof2.events()
        steps = sorted([(e.time_range.start, e.time_range.end) for e in evs if e.name=="STEP"])
        kern = sorted([(e.time_range.start, e.time_range.end, e.name) for e in evs if e.device_type==torch.autograd.DeviceType.CUDA], key=lambda k:k[0])
        ivs=[]; 
        for s,e_,_ in kern:
            if ivs and s<=ivs[-1][1]: ivs[-1][1]=max(ivs[-1][1],e_)
            else: ivs.append([s,e_])
        busy=sum(b-a for a,b in ivs)/N
        tails=[]
        for i,(s,e_) in enumerate(steps):
            nxt = steps[i+1][0] if i+1<len(steps) else 1e30
            last = max([k[1] for k in kern if s<=k[0]<nxt] or [e_])
            tails.append(last-e_)
        kt=collections.Counter(); kc=collections.Counter()
        for s,e_,n in kern: kt[n[:70]]+=(e_-s)/N; kc[n[:70]]+=1/N
        print(m, "GPU busy us/step", round(busy,1), "host step us", round(sum(e_-s for s,e_ in steps)/N,1), "GPU tail after host us", [round(t) for t in tails][:6], "kernels/step", len(kern)/N)
        for n,t in kt.most_common(12): print("   ", round(t,1), round(kc[n],1), n)
        res[m+"_kernels"]=(kt,kc)
    t=time.perf_counter()
    for _ in range(20): step()
    if dev.type=="cuda": torch.cuda.synchronize()
    print(m, "step ms", (time.perf_counter()-t)/20*1e3, "profiled total self us/step", sum(ev.values()))
out = {m: {"self_us": dict(res[m][0]), "calls": dict(res[m][1])} for m in res}
if os.environ.get("OUT"): json.dump(out, open(os.environ["OUT"]+f"/prof_{'_'.join(methods)}.json","w"))
for a,b in zip(methods[0::2], methods[1::2]):
  keys = set(res[a][0])|set(res[b][0])
  rows = sorted(keys, key=lambda k: -(res[b][0].get(k,0)-res[a][0].get(k,0)))
  print(f"{'key':60s} {a:>14s} {b:>14s}  diff(us/step)  calls a/b")
  for k in rows[:40]:
    print(f"{k[:60]:60s} {res[a][0].get(k,0):14.1f} {res[b][0].get(k,0):14.1f} {res[b][0].get(k,0)-res[a][0].get(k,0):12.1f}  {res[a][1].get(k,0):.0f}/{res[b][1].get(k,0):.0f}")
dist.destroy_process_group()
