"""What a user sees of a run: the mesh layout at its start; at its end the memory table, GTP's
counters, a plot, a JSON."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gtp_wrap.runtime.chain import PassKind

MiB = 2**20


def memory_rows(model: nn.Module, optim: torch.optim.Optimizer, full_numel: int) -> list[tuple]:
    """Per-rank bytes of parameters, gradients and optimizer state, and the unsharded bytes."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    optim_bytes = sum(
        t.numel() * t.element_size()
        for state in optim.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    elem = next(model.parameters()).element_size()
    full = full_numel * elem
    per_param_state = optim_bytes / max(params, 1)
    return [
        ("parameters", params, full),
        ("gradients", grads, full),
        ("optimizer state", optim_bytes, int(full * per_param_state)),
    ]


def summary_table(rows: list[tuple], stats: dict, steps: int) -> str:
    lines = [
        f"{'per rank':<18}{'GTP (MiB)':>12}{'unsharded (MiB)':>18}{'ratio':>8}",
        "-" * 56,
    ]
    for name, mine, full in rows:
        ratio = f"{mine / full:.2f}" if full else "-"
        lines.append(f"{name:<18}{mine / MiB:>12.2f}{full / MiB:>18.2f}{ratio:>8}")
    per = max(steps, 1)
    lines += [
        "-" * 56,
        f"after the first step, gathers per step: {stats['gathers'] / per:.0f} "
        f"(prefetched {stats['prefetched_gathers'] / per:.0f}, "
        f"blocking {stats['blocking_gathers'] / per:.1f})",
        "blocking gathers by pass: "
        + (
            ", ".join(
                f"{PassKind(k).label} {v}" for k, v in sorted(stats["blocking_by_pass"].items())
            )
            + " (one chain head per pass; an eval pass records its chain the first time)"
            if stats["blocking_by_pass"]
            else "none (nothing was gathered)"
        ),
        f"bytes per step: gathered {stats['bytes_gathered'] / per / MiB:.1f} MiB, "
        f"reduce-scattered {stats['bytes_reduced'] / per / MiB:.1f} MiB; "
        f"gather buffers {stats['peak_gathered_bytes'] / MiB:.2f} MiB",
    ]
    return "\n".join(lines)


def expert_table(tokens: torch.Tensor) -> str:
    """Routed token slots per expert, as each MoE block's shares in percent: are the experts
    balanced? (`tokens`: [blocks, experts], summed over the run and the data ranks.)"""
    n = tokens.shape[1]
    head = "block  " + " ".join(f"{f'e{e}':>6}" for e in range(n)) + "   max/mean"
    lines = [head]
    for i, row in enumerate(tokens.tolist()):
        total = sum(row) or 1
        shares = " ".join(f"{100 * c / total:5.1f}%" for c in row)
        lines.append(f"{i:>5}  {shares}   {max(row) * n / total:8.2f}")
    return "\n".join(lines)


def plot_losses(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["loss"], label="train", lw=1)
    if history["val_step"]:
        ax.plot(history["val_step"], history["val_loss"], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("gtp-train")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_metrics(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2))


def mesh_layout(meshes: list[DeviceMesh], hosts: list[str], shown: int = 8) -> str:
    """Which ranks form each group of each dim of `meshes` (the dense mesh, and the expert
    mesh where there is one), and the host each rank runs on: what tells whether gtp and egtp
    stay inside a node (the README's multi-node layout advice)."""
    lines = []
    for mesh, i in [(m, i) for m in meshes for i in range(m.ndim)]:
        name, grid = (mesh.mesh_dim_names or ())[i], mesh.mesh
        groups = grid.movedim(i, -1).reshape(-1, grid.shape[i]).tolist()
        text = " ".join(str(g) for g in groups[:shown])
        more = f" ... ({len(groups)} groups)" if len(groups) > shown else ""
        on = (
            "one host each"
            if all(len({hosts[r] for r in g}) == 1 for g in groups)
            else ("across hosts")
        )
        lines.append(f"  {name} groups ({on}): {text}{more}")
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    placed = ", ".join(f"{host}: {ranks}" for host, ranks in list(by_host.items())[:shown])
    return "\n".join(["mesh layout:", *lines, f"  ranks by host: {placed}"])
