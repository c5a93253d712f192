"""Multi-node: torchrun agents as nodes, each its own process, on one host.

Two torchrun agents of 2 CPU ranks each ("nodes"; `--nnodes 2 --nproc_per_node 2`, c10d
rendezvous on 127.0.0.1) start this file as a script: it trains the tied-embedding TinyGPT of
the parity cases on a ("dp", "gtp") mesh with its gtp groups inside the nodes ({0,1}, {2,3}:
`make_mesh`) and on one with its gtp groups across them ({0,2}, {1,3}: the README's
`layout="gtp_outer"` snippet), both against a single-process reference trained on all ranks'
batches.
Then `gtp-train` runs on two such agents through the launch script of the README's multi-node
section, and its losses are compared with the same run on one agent of 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parity_cases import CASES, model_of, train_case
from torch.distributed.device_mesh import DeviceMesh

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.api import engine_of
from gtp_wrap.app.launch import run_rank
from gtp_wrap.app.report import mesh_layout
from gtp_wrap.mesh import DP_GTP, EXPERT_DIMS

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "README.md"  # its multi-node section's launch block is what the test runs
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
AGENT = "GTP_TEST_AGENT"  # which agent process a rank runs under (its "node")
CASE = "gpt_tied"  # TinyGPT with a tied head, clipped: gathers, reduce-scatters, all-reduces
# gtp-train on CPU ranks: a tiny run of the default model and policy.
TRAIN = ["device=cpu", "trainer.steps=4", "trainer.batch=4", "trainer.seq=32",
         "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.log_every=0",
         "checkpoint.every=0"]  # fmt: skip


def _free_port() -> int:
    """A port of 127.0.0.1 free now, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nnodes: int, nproc: int, port: int, *target: str) -> list[str]:
    """One agent's command line: `target` (a script and its arguments, or -m and a module) on
    `nproc` ranks of a c10d rendezvous of `nnodes` agents."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "gtp-test", *target]  # fmt: skip


def _agents(commands: list[list[str]], cwd: Path, env: dict[str, str], timeout: float) -> None:
    """Run each command as one agent ("node" i gets AGENT=i), all at once, and fail with their
    logs if any exits non-zero or all have not ended within `timeout` seconds."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    procs, logs = [], []
    for i, cmd in enumerate(commands):
        logs.append(cwd / f"agent{i}.log")
        with logs[-1].open("w") as out:  # a file, not a pipe: a full pipe would stall a rank
            procs.append(subprocess.Popen(
                cmd, cwd=cwd, env={**base, AGENT: str(i)}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the agent and its ranks
            ))  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        # An agent that failed leaves the others waiting for it at a rendezvous or in a
        # collective: stop at the first failure instead of at the deadline.
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(f"--- agent {i} (exit {rc}):\n{logs[i].read_text()[-3000:]}"
                          for i, rc in failed)  # fmt: skip
        pytest.fail(f"torchrun agents failed or ran past {timeout:.0f}s:\n{tails}")


def _readme_gtp_outer_mesh() -> DeviceMesh:
    """The mesh of the README's gtp_outer snippet, whose own check of this rank's gtp group
    runs here too; its GTPWrap call is `_train_on`'s."""
    section = DOC.read_text().split("### Which mesh axis on which link", 1)[1].split("\n## ")[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README's mesh-layout section has no python block"
    scope = {"gtp_wrap": gtp_wrap, "GTPWrap": lambda *args, **kwargs: None}
    scope |= {"model": None, "policy": None}
    exec(compile(match.group(1), "README.md", "exec"), scope)  # noqa: S102 - the README's code
    return scope["mesh"]


def _bytes_by_axis(model: torch.nn.Module) -> dict[str, int]:
    """Counts the payload bytes of the engine's collectives, by kind and mesh axis, from now on
    (a gather's outputs, a reduce-scatter's inputs, an all-reduce's tensor)."""
    comm, moved = engine_of(model).comm, {}
    all_gather, reduce_scatter, all_reduce = comm.all_gather, comm.reduce_scatter, comm.all_reduce

    def add(kind: str, axis: str, tensors: list[torch.Tensor]) -> None:
        key = f"{kind} over {axis}"
        moved[key] = moved.get(key, 0) + sum(t.numel() * t.element_size() for t in tensors)

    def spy_ag(axis, outs, *args, **kwargs):  # type: ignore[no-untyped-def]
        add("all_gather", axis.name, outs)
        return all_gather(axis, outs, *args, **kwargs)

    def spy_rs(axis, outs, fulls, *args, **kwargs):  # type: ignore[no-untyped-def]
        add("reduce_scatter", axis.name, fulls)
        return reduce_scatter(axis, outs, fulls, *args, **kwargs)

    def spy_ar(t, axis, *args, **kwargs):  # type: ignore[no-untyped-def]
        add("all_reduce", axis.name, [t])
        return all_reduce(t, axis, *args, **kwargs)

    comm.all_gather, comm.reduce_scatter, comm.all_reduce = spy_ag, spy_rs, spy_ar
    return moved


def _train_on(mesh: DeviceMesh) -> dict:
    """The parity case trained on `mesh` by every rank: the losses averaged over the ranks,
    rank 0's grad norms, the full final weights, each rank's groups and bytes moved."""
    case = CASES[CASE]
    model = GTPWrap(model_of(case), case.policy, mesh=mesh)
    moved = _bytes_by_axis(model)
    res = train_case(case, model, dist.get_rank(), dist.get_world_size(), wrapped=True)
    losses = torch.tensor(res["losses"])
    dist.all_reduce(losses)
    groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in DP_GTP}
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"groups": groups, "bytes": moved})
    return {
        "losses": (losses / dist.get_world_size()).tolist(),
        "norms": res["norms"],
        "params": gtp_wrap.full_state_dict(model),
        "ranks": everyone,
    }


def _rank_main(device: torch.device, out: str) -> None:
    """What each rank runs under torchrun: both layouts; rank 0 saves the results to `out`."""
    where: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(where, {k: os.environ[k] for k in (AGENT, "GROUP_RANK", "LOCAL_RANK")})
    results = {
        "where": where,
        "gtp_in_node": _train_on(gtp_wrap.make_mesh(dp=NODES, gtp=PER_NODE, device_type="cpu")[0]),
        "gtp_across_nodes": _train_on(_readme_gtp_outer_mesh()),
    }
    if dist.get_rank() == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both layouts trained on two agents of 2 ranks each (one rendezvous, one process group)."""
    work = tmp_path_factory.mktemp("layouts")
    port, out = _free_port(), work / "results.pt"
    cmd = _torchrun(NODES, PER_NODE, port, str(Path(__file__)), "--out", str(out))
    _agents([cmd] * NODES, work, {}, timeout=150)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def reference() -> dict:
    """The unwrapped case trained in this process on the concatenation of every rank's batch."""
    case = CASES[CASE]
    model = model_of(case)
    res = train_case(case, model, 0, 1, wrapped=False)
    res["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return res


@pytest.mark.timeout(200)
def test_torchrun_numbers_ranks_node_by_node(layouts: dict) -> None:
    """A node's ranks are consecutive: ranks 0,1 run under one agent, 2,3 under the other."""
    agents = [int(w[AGENT]) for w in layouts["where"]]
    assert agents[0] == agents[1] != agents[2] == agents[3], layouts["where"]
    assert [int(w["LOCAL_RANK"]) for w in layouts["where"]] == [0, 1, 0, 1]
    assert [int(w["GROUP_RANK"]) for w in layouts["where"]] == [0, 0, 1, 1]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("layout", "gtp", "dp"),
    [
        ("gtp_in_node", [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
        ("gtp_across_nodes", [[0, 2], [1, 3], [0, 2], [1, 3]], [[0, 1], [0, 1], [2, 3], [2, 3]]),
    ],
)
def test_layout_trains_as_one_process(
    layouts: dict, reference: dict, layout: str, gtp: list, dp: list
) -> None:
    """Each layout's groups are the ones asked for, and it trains as the single process on all
    ranks' batches does: the same losses, grad norms and final weights."""
    got = layouts[layout]
    assert [r["groups"]["gtp"] for r in got["ranks"]] == gtp
    assert [r["groups"]["dp"] for r in got["ranks"]] == dp
    torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["norms"], reference["norms"], rtol=1e-5, atol=1e-6)
    assert got["params"].keys() == reference["params"].keys()
    for key, value in reference["params"].items():
        torch.testing.assert_close(
            got["params"][key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )
    for r in got["ranks"]:
        moved = r["bytes"]
        # Weights travel over gtp only; dp averages what the reduce-scatter left on this rank,
        # 1/gtp of what it took in (README: bytes per step per axis).
        assert {k.split(" over ")[1] for k in moved if not k.startswith("all_reduce")} == {"gtp"}
        assert moved["all_reduce over dp"] * PER_NODE == moved["reduce_scatter over gtp"]
        assert moved["all_gather over gtp"] > 0


def _launch_block() -> str:
    """The README section's launch script: the bash block that runs torchrun on every node."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if "torchrun" in b and "$NNODES" in b and "#SBATCH" not in b]
    assert len(found) == 1, "the multi-node section has no single torchrun launch block"
    return found[0]


def _losses(run_dir: Path) -> list[float]:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world"] == WORLD
    return metrics["history"]["loss"]


@pytest.mark.timeout(300)
def test_gtp_train_on_two_nodes_matches_one_node(tmp_path: Path) -> None:
    """The README's launch script on two agents, mesh [2, 2], with gtp inside the agents and
    across them: the losses of the same run on one agent of 4 ranks."""
    two, one = tmp_path / "two_nodes", tmp_path / "one_node"
    env = {"NNODES": str(NODES), "NPROC": str(PER_NODE), "HEAD": "127.0.0.1",
           "PORT": str(_free_port()), "RUN_ID": "gtp-test"}  # fmt: skip
    script = ["bash", "-c", _launch_block(), "launch", *TRAIN, f"out_dir={two}"]
    _agents([script] * NODES, tmp_path, env, timeout=130)
    alone = _torchrun(1, WORLD, _free_port(), "-m", "gtp_wrap.app.train", "mesh=[2,2]", *TRAIN,
                      f"out_dir={one}")  # fmt: skip
    _agents([alone], tmp_path, {}, timeout=130)
    got, ref = _losses(two), _losses(one)
    assert len(got) == 4
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    # Rank 0 logs the layout it trained on: the gtp groups, one per agent.
    logs = (tmp_path / "agent0.log").read_text() + (tmp_path / "agent1.log").read_text()
    assert "gtp groups (one host each): [0, 1] [2, 3]" in logs, logs[-3000:]
    # gtp across the agents (mesh_layout=gtp_outer): the same training, summed in another order.
    outer = tmp_path / "gtp_outer"
    script = ["bash", "-c", _launch_block(), "launch", *TRAIN, f"out_dir={outer}",
              "mesh_layout=gtp_outer"]  # fmt: skip
    _agents([script] * NODES, tmp_path, {**env, "PORT": str(_free_port())}, timeout=130)
    torch.testing.assert_close(_losses(outer), ref, rtol=1e-5, atol=0)
    logs = (tmp_path / "agent0.log").read_text() + (tmp_path / "agent1.log").read_text()
    assert "gtp groups (one host each): [0, 2] [1, 3]" in logs, logs[-3000:]


@pytest.mark.parametrize(
    ("ranks", "gtp", "dp"),
    [([[0, 1], [2, 3]], "one host each", "across hosts"),
     ([[0, 2], [1, 3]], "across hosts", "one host each")],
)  # fmt: skip
def test_the_mesh_layout_names_each_axis_groups_and_hosts(
    ranks: list[list[int]], gtp: str, dp: str
) -> None:
    """gtp-train's start-up report of a ("dp", "gtp") mesh and an expert mesh (ep 2, egtp 2)
    on two hosts of two ranks each."""
    mesh = DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=DP_GTP,
                      _init_backend=False, _rank=0)  # fmt: skip
    experts = DeviceMesh("cpu", torch.arange(4).view(1, 2, 2), mesh_dim_names=EXPERT_DIMS,
                         _init_backend=False, _rank=0)  # fmt: skip
    text = mesh_layout([mesh, experts], ["node-a", "node-a", "node-b", "node-b"])
    columns = [list(c) for c in zip(*ranks)]
    assert f"gtp groups ({gtp}): {ranks[0]} {ranks[1]}" in text, text
    assert f"dp groups ({dp}): {columns[0]} {columns[1]}" in text, text
    assert "egtp groups (one host each): [0, 1] [2, 3]" in text, text
    assert "ep groups (across hosts): [0, 2] [1, 3]" in text, text
    assert "edp groups (one host each): [0] [1] [2] [3]" in text, text
    assert "ranks by host: node-a: [0, 1], node-b: [2, 3]" in text, text


@pytest.mark.timeout(120)
def test_a_mesh_that_does_not_fill_torchruns_world_stops_every_rank_at_once(
    tmp_path: Path,
) -> None:
    """Under torchrun the mesh is checked against the ranks torchrun started, on every rank
    before any collective: a node given another nproc_per_node (so another mesh) hung waiting
    for its peers; each rank now exits with one line. torchrun ends a rank's peers when it
    exits, so a peer may be stopped before it prints its own (seen once in CI)."""
    cmd = _torchrun(1, PER_NODE, _free_port(), "-m", "gtp_wrap.app.train", "mesh=[2,2]", *TRAIN,
                    f"out_dir={tmp_path / 'run'}")  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode != 0
    line = f"mesh=[2, 2] does not multiply to the {PER_NODE} ranks torchrun started"
    assert line in done.stderr, done.stderr[-3000:]
    assert "CollectiveTimeoutError" not in done.stderr, done.stderr[-3000:]


if __name__ == "__main__":  # a rank started by torchrun (the `layouts` fixture)
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    run_rank(_rank_main, (parser.parse_args().out,), cpu=True)
