"""Muon for wrapped models: torch.optim.Muon's update on sharded matrices, each orthogonalized
once per step by one owner rank (optim/owners.py), and AdamW for the rest.

A step, per Muon matrix: the momentum is updated on this rank's shard (it stays sharded like the
weight, and checkpoints and reshards like AdamW's state); the (Nesterov) update's shards travel
to the matrix's owner, which orthogonalizes the whole matrix (Newton–Schulz, every matrix of one
shape as one batch); each rank gets its box of the result back and applies weight decay and the
shape-adjusted learning rate to its shard. Two collectives per step, whatever the number of
matrices. In one process (or with a model that is not wrapped) nothing travels: it is
torch.optim.Muon plus torch.optim.AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw

from ..core.weight import CastWeight, ShardedWeight
from ..errors import GraphCaptureError, WrapError
from ..io.state_dict import dtensor_shape, local_box
from ..runtime.engine import GTPEngine, engines_of
from .newton_schulz import adjusted_lr, cost, orthogonalize
from .owners import Box, OwnerPlan

_ADAMW_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}


class Muon(torch.optim.Optimizer):
    """Muon on a wrapped model's matrices, AdamW on the rest (see the module docstring).

    Args:
        params: parameters or param groups, as any optimizer takes them. A group with
            `use_muon=False` is stepped by AdamW with its own `lr`, `betas`, `eps` and
            `weight_decay` (defaults (0.9, 0.95), 1e-8 and 0.0); `use_muon=True` takes
            matrices (2-D) and expert stacks (3-D: one orthogonalization per expert). A group
            without the key is split: its >= 2-D parameters use Muon, the rest AdamW.
            `muon_param_groups` builds groups that send embeddings and heads to AdamW by FQN.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            torch.optim.Muon's, with its defaults.

    `orthogonalized` counts the matrices (each expert of a stack) this rank orthogonalized
    and `collectives` the collectives its steps issued, since construction.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"Muon: lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, "
                f"{weight_decay}"
            )
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(
                f"Muon: adjust_lr_fn={adjust_lr_fn!r}; use None, 'original' or 'match_rms_adamw'"
            )
        if len(ns_coefficients) != 3 or not 0 < ns_steps < 100:
            raise ValueError(
                "Muon: ns_coefficients must be three numbers and ns_steps between 1 and 99"
            )
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )  # fmt: skip
        if isinstance(params, set):
            raise TypeError(
                "optimizer parameters must be an ordered collection (a set has another order "
                "on each rank); give a list"
            )
        self.orthogonalized = 0
        self.collectives = 0
        self._plan: OwnerPlan | None = None
        self._planned: list[torch.Tensor] = []  # the Muon matrices the plan routes, in order
        self._index: dict[int, int] = {}  # a planned matrix's id -> its place in `_planned`
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (split by dims when it has no `use_muon`, see the class docstring)."""
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError(
                "optimizer parameters must be an ordered collection (a set has another order "
                "on each rank); give a list"
            )
        params = [params] if isinstance(params, torch.Tensor) else list(params)

        def tensor(p: Any) -> torch.Tensor:  # a parameter, or a (name, parameter) pair
            return p[1] if isinstance(p, tuple) else p

        if "use_muon" not in param_group:
            for use_muon, chosen in (
                (True, [p for p in params if tensor(p).ndim >= 2]),
                (False, [p for p in params if tensor(p).ndim < 2]),
            ):
                if chosen:
                    self.add_param_group({**param_group, "params": chosen, "use_muon": use_muon})
            return
        group = {**param_group, "params": params}
        if group["use_muon"]:
            for p in map(tensor, params):
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon orthogonalizes matrices (2-D) and expert stacks (3-D), not a "
                        f"parameter of shape {tuple(p.shape)}: put it in a use_muon=False group"
                    )
        else:
            for key, value in _ADAMW_DEFAULTS.items():
                group.setdefault(key, value)
        super().add_param_group(group)
        self._plan = None  # the matrices changed: route them again at the next step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of Muon on the matrices and AdamW on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items: list[tuple[torch.Tensor, dict, torch.Tensor]] = []
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw(group)
                continue
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                items.append((p, group, update))
        results = self._orthogonalized(items)
        for (p, group, _), result in zip(items, results):
            lr = group["lr"]
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(result.view(p.shape), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], _shape(p)))
        return loss

    # ---- AdamW for the rest ---------------------------------------------------------------

    def _adamw(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            beta1, beta2 = group["betas"]
            adamw(
                params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=beta1,
                beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=False,
            )  # fmt: skip

    # ---- orthogonalization: locally, or by the owners -------------------------------------

    def _orthogonalized(
        self, items: list[tuple[torch.Tensor, dict, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Each item's orthogonalized update, this rank's box of it."""
        engine = _engine_of([p for p, _, _ in items])
        if engine is None:  # whole matrices on every rank: orthogonalize them here
            return self._orthogonalize_all([(u.view(_shape(p)), g) for p, g, u in items])
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise GraphCaptureError(
                "gtp_wrap.optim.Muon exchanges matrices between ranks with split sizes no "
                "CUDA graph has been verified with: step it outside graph_step (or use AdamW "
                "inside the captured step)"
            )
        plan = self._owner_plan(engine)
        index = self._index
        order = sorted(range(len(items)), key=lambda k: index[id(items[k][0])])
        active = tuple(index[id(items[k][0])] for k in order)
        by_matrix = {index[id(p)]: (p, g, u) for p, g, u in items}
        exchange = plan.exchange(active)
        send_in, recv_in, send_out, recv_out = exchange.sizes(plan.mine)
        device = items[order[0]][2].device
        # In: this rank's boxes of the updates to their owners.
        sent = [by_matrix[i][2].reshape(-1) for to in exchange.send_in for i in to]
        received = self._all_to_all(sent, recv_in, send_in, device)
        fulls: dict[int, torch.Tensor] = {}
        at = 0
        for of in exchange.recv_in:
            for i, box in of:
                full = fulls.get(i)
                if full is None:
                    shape = _shape(by_matrix[i][0])
                    full = fulls[i] = torch.empty(shape, dtype=torch.bfloat16, device=device)
                full[box.index] = received[at : at + box.numel].view(box.shape)
                at += box.numel
        owned = sorted(fulls)
        done = dict(
            zip(owned, self._orthogonalize_all([(fulls[i], by_matrix[i][1]) for i in owned]))
        )
        # Out: each rank's box of each orthogonalized matrix this rank owns.
        sent = [done[i][box.index].reshape(-1) for to in exchange.send_out for i, box in to]
        back = self._all_to_all(sent, recv_out, send_out, device)
        mine: dict[int, torch.Tensor] = {}
        at = 0
        for owned_there in exchange.recv_out:
            for i in owned_there:
                numel = plan.mine[i].numel
                mine[i] = back[at : at + numel]
                at += numel
        return [mine[index[id(p)]] for p, _, _ in items]

    def _all_to_all(
        self, pieces: list[torch.Tensor], recv: list[int], send: list[int], device: torch.device
    ) -> torch.Tensor:
        flat = torch.cat([t.to(torch.bfloat16) for t in pieces]) if pieces else None
        if flat is None:
            flat = torch.empty(0, dtype=torch.bfloat16, device=device)
        out = torch.empty(sum(recv), dtype=torch.bfloat16, device=device)
        dist.all_to_all_single(out, flat, recv, send)
        self.collectives += 1
        return out

    def _orthogonalize_all(self, matrices: list[tuple[torch.Tensor, dict]]) -> list[torch.Tensor]:
        """Orthogonalize each (matrix or stack, its group), those of one shape and NS settings
        as one batch."""
        batches: dict[tuple, list[int]] = {}
        for k, (m, g) in enumerate(matrices):
            key = (tuple(m.shape[-2:]), g["ns_coefficients"], g["ns_steps"], g["eps"])
            batches.setdefault(key, []).append(k)
        out: list[torch.Tensor] = [torch.empty(0)] * len(matrices)
        for (_, coefficients, steps, eps), members in batches.items():
            stacked = torch.cat([matrices[k][0].reshape(-1, *matrices[k][0].shape[-2:])
                                 for k in members])  # fmt: skip
            result = orthogonalize(stacked, coefficients, steps, eps)
            self.orthogonalized += result.shape[0]
            at = 0
            for k in members:
                m = matrices[k][0]
                count = m.numel() // (m.shape[-2] * m.shape[-1])
                out[k] = result[at : at + count].view(m.shape)
                at += count
        return out

    def _owner_plan(self, engine: GTPEngine) -> OwnerPlan:
        """The routes of every Muon matrix, from every rank's boxes (exchanged through the
        store once, and again when param groups change)."""
        if self._plan is not None:
            return self._plan
        matrices = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
        boxes = [_box(engine, p) for p in matrices]
        values = [v for p, box in zip(matrices, boxes)
                  for v in [*_full(p).encode(), *box.encode()]]  # fmt: skip
        per_rank = engine.agreement.exchange(
            "muon-boxes", values, "the exchange of the Muon matrices' boxes"
        )
        shapes = [_full(p).encode() for p in matrices]
        if any(len(v) != len(values) for v in per_rank) or any(
            _decoded_shapes(v, len(matrices)) != shapes for v in per_rank
        ):
            raise WrapError(
                "ranks built Muon over different matrices: give every rank the same param groups"
            )
        boxes_by_rank = []
        for v in per_rank:
            at, mine = 0, []
            for _ in matrices:
                _, at = Box.decode(v, at)  # the logical shape, the same on every rank
                box, at = Box.decode(v, at)
                mine.append(box)
            boxes_by_rank.append(mine)
        self._plan = OwnerPlan([_shape(p) for p in matrices], boxes_by_rank, dist.get_rank())
        self._planned = matrices
        self._index = {id(p): i for i, p in enumerate(matrices)}
        return self._plan

    def ns_load(self) -> list[int]:
        """Each rank's Newton–Schulz cost per step (max(M, N) min(M, N)^2 per matrix) under
        the current owners, all matrices having gradients; one entry in one process."""
        matrices = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
        engine = _engine_of(matrices)
        if engine is None:
            return [sum(cost(_shape(p)) for p in matrices)]
        return self._owner_plan(engine).load([_shape(p) for p in self._planned])


def muon_param_groups(
    model: torch.nn.Module, adamw: Iterable[str] = (), **muon: Any
) -> list[dict[str, Any]]:
    """Param groups for `Muon`: the >= 2-D parameters whose FQN matches no glob of `adamw`
    (e.g. ["embed.*", "head.*"]) use Muon, with `muon`'s settings (lr, momentum, ...); every
    other parameter uses AdamW with the optimizer's defaults."""
    import fnmatch

    patterns = list(adamw)
    matrices: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for name, p in model.named_parameters():
        to_adamw = p.ndim < 2 or any(fnmatch.fnmatchcase(name, pat) for pat in patterns)
        (rest if to_adamw else matrices).append(p)
    return [
        {"params": matrices, "use_muon": True, **muon},
        {"params": rest, "use_muon": False},
    ]


def _decoded_shapes(values: list[int], count: int) -> list[list[int]]:
    """The logical-shape boxes of `count` matrices in a rank's exchanged values."""
    shapes, at = [], 0
    for _ in range(count):
        shape, at = Box.decode(values, at)
        _, at = Box.decode(values, at)
        shapes.append(shape.encode())
    return shapes


def _managed(p: torch.Tensor) -> ShardedWeight | CastWeight | None:
    w = getattr(p, "gtp_weight", None)
    return w if isinstance(w, (ShardedWeight, CastWeight)) else None


def _engine_of(params: list[torch.Tensor]) -> GTPEngine | None:
    """The distributed engine the parameters belong to; None when none does (one process, or
    a model that is not wrapped), so matrices are whole on every rank."""
    engines = engines_of(params)
    if len(engines) > 1:
        raise ValueError(
            "Muon got parameters of several wrapped models: give each model an optimizer of its own"
        )
    engine = next(iter(engines), None)
    if engine is None or engine.mesh.device_mesh is None:
        return None
    return engine if engine.mesh.world_size > 1 else None


def _shape(p: torch.Tensor) -> torch.Size:
    """The logical shape of a parameter: the whole matrix, over every rank."""
    w = _managed(p)
    if isinstance(w, ShardedWeight) or (isinstance(w, CastWeight) and w.tp is not None):
        return dtensor_shape(w)
    with torch._C.DisableTorchFunctionSubclass():
        return p.shape


def _full(p: torch.Tensor) -> Box:
    shape = tuple(_shape(p))
    return Box(tuple([0] * len(shape)), shape)


def _box(engine: GTPEngine, p: torch.Tensor) -> Box:
    """This rank's box of a parameter's logical matrix."""
    w = _managed(p)
    if w is None or (isinstance(w, CastWeight) and w.tp is None):
        return _full(p)
    offset, shape = local_box(engine, w)
    return Box(offset, shape)
