"""Tensor parallelism composed with GTP: the policy's `tp` rules applied as torch's styles, and
the weights torch's TP made DTensors, taken apart at wrap time and put together again at every
use.

[Note: GTP over tensor parallelism] `parallelize_module(model, mesh["tp"], plan)` makes each
planned weight a DTensor over the tp dim (ColwiseParallel: Shard(0), RowwiseParallel: Shard(1),
SequenceParallel's norms: Replicate), and its styles' hooks hand the modules DTensor inputs, so
the modules' ops run as DTensor ops. GTP then works on the tp-local tensor alone, as Megatron's
GTP shards the TP-local weight: before planning, every DTensor parameter is replaced by a plain
parameter holding its local tensor, and its `TPLayout` (tp mesh, placements, global shape) is
kept. A sharded weight's gathered full weight is that local tensor, and a replicated one's
compute copy too; each use hands the module `TPLayout.wrap` of it, a DTensor again, built
without communication. Its gradient comes back through `from_local`'s backward as a local
gradient, which GTP reduce-scatters over gtp (and the replicated ones all-reduce over dp x gtp)
as any other. The ranks of one tp group read the same batch (torch's TP needs it), so they are
one data rank between them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement

from ..config.policy import TPStyle
from ..errors import PolicyError, WrapError
from ..mesh import GTPMesh


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How one parameter was laid out by tensor parallelism: enough to make a DTensor of its
    tp-local tensor again."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size  # the global (logical) shape over every tp rank
    stride: tuple[int, ...]

    @property
    def placement(self) -> Placement:
        """The placement over the tp dim (the layout's mesh is that one dim)."""
        return self.placements[0]

    @property
    def sharded(self) -> bool:
        """Whether the tp ranks hold different parts of it (a Shard, not a Replicate)."""
        return isinstance(self.placement, Shard)

    def wrap(self, local: torch.Tensor) -> DTensor:
        """`local` (this rank's tp block, or a view of the same shape) as the parameter's
        DTensor; differentiable, no communication."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape,
            stride=self.stride,
        )  # fmt: skip

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's tp block of the global tensor `full`, as torch's Shard splits it."""
        placement = self.placement
        if not isinstance(placement, Shard):
            return full
        rank = self.mesh.get_local_rank(0)
        blocks = torch.chunk(full, self.mesh.size(0), placement.dim)
        if rank < len(blocks):
            return blocks[rank]
        return full.narrow(placement.dim, 0, 0)


def apply_tp_plan(module: nn.Module, plan: dict[str, TPStyle], mesh: GTPMesh) -> None:
    """Give each module of `plan` (module FQN -> style, from the policy's `tp` rules) its style
    of torch's tensor parallelism over the mesh's "tp" dim (see LayerRule for the styles). A
    module the style does not fit is refused, naming it: torch's styles would fail later in a
    forward, or shard silently wrong."""
    if not plan:
        return
    if mesh.tp_mesh is None:
        raise PolicyError(
            f"the policy gives {len(plan)} module(s) a tensor-parallel style (e.g. "
            f"'{next(iter(plan))}'), but the mesh has no 'tp' dim: pass a mesh with one "
            "(gtp_wrap.make_mesh(gtp=..., tp=...); gtp-train mesh=[dp, gtp, tp])"
        )
    tp = mesh.tp.size
    _check_sequence_styles(module, plan)
    sequence = "sequence" in plan.values()
    shared = _shared_weights(module)
    styles: dict[str, ParallelStyle] = {}
    for fqn, style in plan.items():
        mod = module.get_submodule(fqn)
        if style in ("colwise", "rowwise"):
            _check_splittable(fqn, mod, style, tp, shared)
        styles[fqn] = _style(style, mod, sequence)
    parallelize_module(module, mesh.tp_mesh, styles)


_SEQUENCE_STYLES = ("sequence", "split_sequence", "gather_sequence")


def _check_sequence_styles(module: nn.Module, plan: dict[str, TPStyle]) -> None:
    """Sequence parallelism is all or nothing: the stream split where it starts, joined where
    it ends, and every module holding parameters styled. A plain parameter on the split stream
    would get only this rank's part of its gradient, silently (its module must be `sequence`)."""
    used = {s for s in plan.values() if s in _SEQUENCE_STYLES}
    if not used:
        return
    if used != set(_SEQUENCE_STYLES):
        missing = sorted(set(_SEQUENCE_STYLES) - used)
        raise PolicyError(
            f"the policy's tp rules use {sorted(used)} but not {missing}: sequence parallelism "
            "needs all three (sequence on the norms, split_sequence where the stream starts, "
            "gather_sequence where it ends)"
        )
    for fqn, mod in module.named_modules():
        if fqn not in plan and any(p is not None for p in mod._parameters.values()):
            raise PolicyError(
                f"with sequence parallelism, '{fqn}' ({type(mod).__name__}) holds parameters "
                "but has no tp style: on activations split over the sequence its parameters' "
                "gradients would be only this rank's part. Give it a tp rule (sequence for a "
                "norm), or apply your own parallelize_module plan before GTPWrap"
            )


def _style(style: TPStyle, mod: nn.Module, sequence: bool) -> ParallelStyle:
    """Torch's style object for one module; with sequence parallelism, the layers around the
    split stream gather its input or split their output over the sequence (dim 1)."""
    stream = Shard(1) if sequence else Replicate()
    embedding = isinstance(mod, nn.Embedding)
    if style == "colwise":
        return ColwiseParallel() if embedding else ColwiseParallel(input_layouts=stream)
    if style == "rowwise":
        if embedding:  # token ids in, whole on every rank
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        return RowwiseParallel(output_layouts=stream)
    if style == "sequence":
        return SequenceParallel()
    if style == "split_sequence":
        return PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        )
    return PrepareModuleInput(  # gather_sequence
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )


def _shared_weights(module: nn.Module) -> dict[int, list[str]]:
    """The FQNs of each parameter registered under more than one name (tied weights)."""
    names: dict[int, list[str]] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    return {k: v for k, v in names.items() if len(v) > 1}


def _check_splittable(
    fqn: str, mod: nn.Module, style: str, tp: int, shared: dict[int, list[str]]
) -> None:
    if not isinstance(mod, nn.Linear | nn.Embedding):
        raise PolicyError(
            f"tp: {style} on '{fqn}', a {type(mod).__name__}: torch's {style} style splits "
            "the weight of a Linear or an Embedding only; match those modules, or apply your "
            "own parallelize_module plan before GTPWrap"
        )
    weight = mod.weight
    names = shared.get(id(weight))
    if names is not None:
        raise PolicyError(
            f"tp: {style} on '{fqn}', whose weight is tied ({', '.join(names)}): torch's "
            "tensor parallelism would give each owner a DTensor of its own and untie it "
            "silently; leave tied weights to GTP (no tp rule on their modules)"
        )
    # Linear: colwise splits out_features (dim 0), rowwise in_features (dim 1); Embedding:
    # colwise splits the embedding dim (1), rowwise the vocabulary (0).
    dim = (0 if style == "colwise" else 1) ^ isinstance(mod, nn.Embedding)
    if weight.shape[dim] % tp:
        raise PolicyError(
            f"tp: {style} splits dim {dim} of '{fqn}.weight' (shape {tuple(weight.shape)}) "
            f"over tp={tp} ranks, which does not divide {weight.shape[dim]}: pick a tp that "
            "divides it"
        )


def take_tp_layouts(module: nn.Module, mesh: GTPMesh) -> dict[int, TPLayout]:
    """Replace every DTensor parameter of `module` with a plain parameter holding its local
    tensor, wherever it is registered; return each new parameter's layout, by id.

    A DTensor must live on the mesh's "tp" dim with one Shard or Replicate placement: any other
    (a DTensor from FSDP2, or on another mesh) is refused, naming the parameter.
    """
    layouts: dict[int, TPLayout] = {}
    replaced: dict[int, nn.Parameter] = {}
    for mod_fqn, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if not isinstance(p, DTensor):
                continue
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            new = replaced.get(id(p))
            if new is None:
                layout = _layout_of(fqn, p, mesh)
                new = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                replaced[id(p)] = new
                layouts[id(new)] = layout
            mod._parameters[name] = new
    if mesh.tp.size > 1 and not layouts:
        raise WrapError(
            f"the mesh has a tp dim of {mesh.tp.size} ranks, but no parameter of "
            f"{type(module).__name__} is tensor-parallel: its tp ranks would compute the same "
            "thing twice and never agree on their gradients. Apply tensor parallelism (the "
            "policy's tp rules, or parallelize_module on mesh['tp'] before GTPWrap), or leave "
            "tp out of the mesh"
        )
    return layouts


def _layout_of(fqn: str, p: DTensor, mesh: GTPMesh) -> TPLayout:
    if mesh.tp_mesh is None:
        raise WrapError(
            f"'{fqn}' is a DTensor (placements {list(p.placements)}), but the mesh given to "
            "GTPWrap has no 'tp' dim: pass the mesh whose mesh['tp'] the tensor-parallel plan "
            "was applied on (gtp_wrap.make_mesh(gtp=..., tp=...)), or wrap a model without "
            "DTensor parameters"
        )
    if p.device_mesh != mesh.tp_mesh:
        raise WrapError(
            f"'{fqn}' is a DTensor on a mesh of dims {p.device_mesh.mesh_dim_names} "
            f"{tuple(p.device_mesh.mesh.shape)}, not on the 'tp' dim of the mesh given to "
            "GTPWrap: apply parallelize_module with mesh['tp'] of that same mesh"
        )
    (placement,) = p.placements
    if not isinstance(placement, Shard | Replicate):
        raise WrapError(
            f"'{fqn}' has placement {placement} over tp; GTP takes weights that tensor "
            "parallelism shards (Shard) or replicates (Replicate)"
        )
    return TPLayout(p.device_mesh, tuple(p.placements), p.shape, p.stride())
