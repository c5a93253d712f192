"""Measured runs against the model: each run stored in a cluster's calibration JSON (`runs`),
predicted from that JSON's rates, with its error.

A run names bench_step's method: `floor` / `floor_graph` (no communication, eager / graphed),
`gtp` / `gtp_graph` (the engine, eager / graphed), `gtp_blocks` (the engine with its blocks
on gathered weights, eager), `fsdp2`, or `plain` (calibrate.py's forward
and backward of the unwrapped model, no optimizer); the model by a name of
`model.MODELS` or inline (`"model": {...ModelConfig fields}`, for the small CPU models), the
mesh as `gtp-plan` writes it, and `calibration: true` when the JSON's rates were fitted to it
(those cannot test the model; the others are held out). A run on a shared CPU carries
`probe_s`, a fixed GEMM loop timed in every rank just before its steps: against the
calibration's own (`probe_s` of the JSON) it says how much slower the ranks computed then
(oversubscription and the neighbours' load), which the prediction takes as its slowdown.
A run on a GPU carries `host_probe_ms`, benchmarks/host_probe.py's host-bound workload timed
beside its steps: against the calibration's own (`host_probe_ms` of the JSON, measured on the
host its host costs came from) it says how much slower that host launched work, which scales
the prediction's host time (an eager batch-1 step is host-bound; hosts of one kind ran one
step up to 1.8 x apart). A run with `"comm": "faked"` ran its ranks' collectives on torch's fake
process group (benchmarks/fake_world.py: the engine's host path of N ranks on one device, no
bytes moved), and is predicted with collectives that take no time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .baselines import predict_method
from .cluster import Cluster
from .mesh import Mesh
from .model import ModelConfig, model_by_name
from .precision import Precision
from .predict import Plan, optimizer_s, predict

TARGET = 0.10  # the bound on step-time error


@dataclasses.dataclass(frozen=True)
class Check:
    """One run: measured and predicted step (ms), and whether it was calibrated on."""

    run: dict[str, Any]
    predicted_ms: float

    @property
    def measured_ms(self) -> float:
        return float(self.run["measured_ms"])

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return self.predicted_ms / self.measured_ms - 1.0

    @property
    def calibration(self) -> bool:
        return bool(self.run.get("calibration", False))

    def label(self) -> str:
        r = self.run
        model = r["model"] if isinstance(r["model"], str) else r["model"]["name"]
        mesh = r.get("mesh") or "world 1"
        faked = " (faked comm)" if r.get("comm") == "faked" else ""
        return f"{model} b{r['batch']} {mesh}{faked} {r['method']}"


def run_model(run: dict[str, Any]) -> ModelConfig:
    spec = run["model"]
    return model_by_name(spec) if isinstance(spec, str) else ModelConfig(**spec)


def plan_of(cluster: Cluster, run: dict[str, Any]) -> tuple[Plan, str]:
    """The plan and cost-model method of a stored run."""
    method = run["method"]
    graphed = method.endswith("_graph")
    policy = run.get("policy", {})
    faked = run.get("comm") == "faked"
    plan = Plan(
        run_model(run),
        cluster.without_comm() if faked else cluster,
        Mesh.parse(run.get("mesh", "")),
        batch=run["batch"],
        seq=run["seq"],
        precision=Precision(
            gather=policy.get("gather", "bf16"), reduce=policy.get("reduce", "fp32")
        ),
        graphed=graphed,
        prefetch_depth=policy.get("prefetch_depth", 1),
        group_numel=policy.get("group_numel", 1 << 24),
        slowdown=run.get("probe_s", 0.0) / cluster.probe_s if cluster.probe_s else 0.0,
        host_slowdown=host_slowdown(cluster, run),
    )
    return plan, method.removesuffix("_graph")


def host_slowdown(cluster: Cluster, run: dict[str, Any]) -> float:
    """How many times slower the run's host launched work than the calibration's (0: unknown,
    taken as equal): both probes must exist, and only where the host runs ahead of the device
    (on a CPU the GEMM probe's `slowdown` covers the host, which is the same cores)."""
    probe = run.get("host_probe_ms", 0.0)
    if not (cluster.async_host and cluster.host_probe_ms and probe):
        return 0.0
    return float(probe) / cluster.host_probe_ms


def predicted_ms(cluster: Cluster, run: dict[str, Any]) -> float:
    """A run's predicted step; `plain` (the model's forward and backward alone, as calibrate.py
    times it) is the floor without its optimizer step."""
    plan, method = plan_of(cluster, run)
    if method == "plain":
        share = plan.share
        return (predict(plan, "floor").step - share * optimizer_s(plan, "floor")) * 1e3
    return predict_method(plan, method).step * 1e3


def check(cluster: Cluster) -> list[Check]:
    """Every stored run of `cluster`, predicted."""
    return [Check(run, predicted_ms(cluster, run)) for run in cluster.runs]


def table(checks: list[Check]) -> str:
    """A Markdown table of the checks, calibration runs marked."""
    lines = [
        "| run | measured ms | predicted ms | error | set | source |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        kind = "calibration" if c.calibration else "held out"
        lines.append(
            f"| {c.label()} | {c.measured_ms:.1f} | {c.predicted_ms:.1f} | {c.error:+.1%} | "
            f"{kind} | {c.run.get('source', '')} |"
        )
    held = [c for c in checks if not c.calibration]
    if held:
        within = sum(abs(c.error) <= TARGET for c in held)
        lines.append("")
        lines.append(f"held out: {within} of {len(held)} within {TARGET:.0%}")
    return "\n".join(lines)
