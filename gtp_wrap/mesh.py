"""Named mesh roles: which process group each kind of collective of an engine runs over.

A `DeviceMesh` given to GTPWrap has its dims named from `MESH_DIMS` ("dp", "gtp", "tp"; any
subset holding "gtp", in that order, so tensor parallelism stays innermost, on the fastest
links). Each role is a `MeshAxis`: sharded weights are gathered and their gradients
reduce-scattered over `gtp`, those gradients are then averaged over `dp` (the replicate axis),
and replicated parameters are all-reduced over `data`, the dp x gtp ranks that each read a
batch of their own. The ranks of one `tp` group read the same batch and split the layers'
compute, as torch's tensor parallelism does (parallel/tensor.py). This is the one place
that knows the dims' names; the engine and the state dicts ask it for groups and DTensor
placements.

An `expert_mesh` factors the same world again for expert stacks, with dims from EXPERT_DIMS
("edp", "ep", "egtp"): a stack is partitioned over `ep` (each rank keeps its experts), its part
sharded over `egtp` and replicated over `edp` (see parallel/experts.py).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .errors import WrapError

DP, GTP, TP = "dp", "gtp", "tp"
MESH_DIMS = (DP, GTP, TP)  # outermost first
DP_GTP = (DP, GTP)  # the 2-D mesh of data parallelism over GTP groups
EDP, EP, EGTP = "edp", "ep", "egtp"
EXPERT_DIMS = (EDP, EP, EGTP)  # the expert factorization of the same world, outermost first


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One role: the group its collectives run over (None: the default group, or no group at
    all when not distributed), and this rank's place in it."""

    name: str
    group: dist.ProcessGroup | None
    rank: int
    size: int


@dataclasses.dataclass(frozen=True)
class GTPMesh:
    """The roles of one engine. `device_mesh` is None when not distributed."""

    device_mesh: DeviceMesh | None
    gtp: MeshAxis  # weights are sharded over it
    dp: MeshAxis  # weights are replicated over it: their gradients are all-reduced after
    tp: MeshAxis  # torch's tensor parallelism: the layers' compute is split over it
    data: MeshAxis  # every rank reading a batch of its own: replicated parameters' gradients
    world: MeshAxis  # every rank
    tp_mesh: DeviceMesh | None = None  # the "tp" dim, where tensor-parallel DTensors live
    # The expert factorization of the same world (parallel/experts.py): expert stacks are
    # partitioned over ep, sharded over egtp and replicated over edp.
    expert_mesh: DeviceMesh | None = None
    egtp: MeshAxis = MeshAxis(EGTP, None, 0, 1)
    ep: MeshAxis = MeshAxis(EP, None, 0, 1)
    edp: MeshAxis = MeshAxis(EDP, None, 0, 1)
    # `data`'s ranks on a group of their own, where `data`'s carries collectives of backward
    # (see with_replicated_apart); None: `data`'s group serves.
    apart: MeshAxis | None = None

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def replicated(self) -> MeshAxis:
        """The axis the replicated parameters' gradients are all-reduced over."""
        return self.apart or self.data

    def replicas(self, axis: MeshAxis) -> MeshAxis:
        """The axis a weight sharded over `axis` is replicated over: its gradient, reduced
        over `axis`, is then reduced over this one (dp for gtp, edp for egtp)."""
        return self.edp if axis.name == EGTP else self.dp

    def expert_placements(self, dim: int) -> list[Placement]:
        """DTensor placements over the expert mesh of an expert stack sharded along `dim`
        over egtp and partitioned along dim 0 (its experts) over ep. Where both split dim 0,
        DTensor's left-to-right order is the one parallel/experts.py uses: ep's block first,
        then egtp's rows of it."""
        by_name = {EDP: Replicate(), EP: Shard(0), EGTP: Shard(dim)}
        assert self.expert_mesh is not None  # only distributed engines make DTensors
        return [by_name[name] for name in self.expert_mesh.mesh_dim_names or ()]

    def placements(self, dim: int | None, tp: Placement | None = None) -> list[Placement]:
        """DTensor placements of a weight sharded along `dim` over gtp (None: replicated over
        it), one per mesh dim; `tp`: the weight's placement over the tp dim, whose local tensor
        GTP shards. Where both split the same dim, each tp block is split over gtp: a strided
        shard."""
        assert self.device_mesh is not None  # only distributed engines make DTensors
        if self.device_mesh.ndim == 1:  # the GTP group itself, whatever its dim is named
            return [Replicate() if dim is None else Shard(dim)]
        over_gtp: Placement = Replicate() if dim is None else Shard(dim)
        if dim is not None and isinstance(tp, Shard) and tp.dim == dim:
            over_gtp = _StridedShard(dim, split_factor=self.tp.size)
        by_name = {DP: Replicate(), GTP: over_gtp, TP: tp or Replicate()}
        return [by_name[name] for name in self.device_mesh.mesh_dim_names or ()]


# Groups made for replicated all-reduces, by their ranks: every engine of a process over the
# same ranks (an EMA or teacher copy, a benchmark's sweep) shares one communicator.
_apart: dict[tuple[int, tuple[tuple[int, ...], ...]], dist.ProcessGroup] = {}


def with_replicated_apart(mesh: GTPMesh) -> GTPMesh:
    """`mesh` whose `replicated` axis is `data` on a process group of its own, where `data`'s
    group also carries collectives of backward (made by every rank in the same order; call it
    where every rank is known to wrap alike, before any rank's own work can fail).

    [Note: replicated all-reduces on a group of their own] A bucket of replicated gradients is
    all-reduced as soon as its gradients are in, in the middle of backward, where the sharded
    weights' reduce-scatters run too. Which moment that is depends on this rank's graph: a
    parameter that one rank's data leaves unused (a branch, an expert's bias) has no gradient
    there, so that rank launches the bucket only when backward ends. On one process group, the
    ranks would then issue the all-reduce and the reduce-scatters in different orders: gloo
    aborts with a size mismatch, NCCL hangs or mixes the data. On a group of their own the
    all-reduces may run at different moments on different ranks and still meet, as long as
    each rank launches its buckets in one fixed order (runtime/replicated.py); the other
    collectives never wait for them. A 1-D mesh over the world shares the default group with
    `data`, as does an expert mesh's whole-world egtp; a (dp, gtp) mesh's data group (the
    default group) carries nothing in backward, and needs no group of its own."""
    if mesh.device_mesh is None or mesh.data.size == 1:
        return mesh

    def pg(axis: MeshAxis) -> dist.ProcessGroup | None:
        return axis.group if axis.group is not None else dist.group.WORLD

    backward = (mesh.gtp, mesh.dp, mesh.tp, mesh.egtp, mesh.ep, mesh.edp)
    if all(pg(a) is not pg(mesh.data) for a in backward if a.size > 1):
        return mesh
    grid = mesh.device_mesh.mesh
    if mesh.tp.size > 1:  # the dp x gtp ranks of each tp coordinate (tp is innermost)
        groups = [grid[..., t].flatten().tolist() for t in range(grid.shape[-1])]
    else:
        groups = [grid.flatten().tolist()]
    key = (id(dist.group.WORLD), tuple(tuple(g) for g in groups))
    if key not in _apart:
        _apart[key], _ = dist.new_subgroups_by_enumeration(
            groups, group_desc="gtp_replicated_grads"
        )
    rank = dist.get_rank()
    (mine,) = [g for g in groups if rank in g]
    apart = MeshAxis("replicated", _apart[key], mine.index(rank), len(mine))
    return dataclasses.replace(mesh, apart=apart)


def make_mesh(
    dp: int = 1,
    gtp: int = -1,
    tp: int = 1,
    ep: int = 1,
    egtp: int = 1,
    device_type: str | None = None,
    layout: str = "gtp_inner",
) -> tuple[DeviceMesh, DeviceMesh]:
    """`(mesh, expert_mesh)` over the whole world. `mesh` is `dense_mesh(dp, gtp, tp,
    device_type, layout)`. `expert_mesh` factors the same world for expert weights as ("edp",
    "ep", "egtp"), edp being what ep x egtp leave, row-major whatever `layout` (egtp groups
    runs of consecutive ranks): GTPWrap's `expert_mesh`. `device_type`: "cuda" where a GPU is
    present, else "cpu", by default."""
    experts = make_expert_mesh(ep, egtp, device_type)
    return dense_mesh(dp, gtp, tp, device_type, layout), experts


def make_expert_mesh(ep: int = 1, egtp: int = 1, device_type: str | None = None) -> DeviceMesh:
    """The expert mesh ("edp", "ep", "egtp") over the whole world, edp being what ep x egtp
    leave (`make_mesh`'s second mesh)."""
    if not dist.is_initialized():
        raise WrapError("make_mesh needs torch.distributed: call dist.init_process_group() first")
    world = dist.get_world_size()
    if ep < 1 or egtp < 1 or world % (ep * egtp):
        raise WrapError(
            f"make_mesh(ep={ep}, egtp={egtp}): give each as a whole number >= 1; ep x egtp must "
            f"divide the world of {world} ranks"
        )
    experts = (world // (ep * egtp), ep, egtp)
    return init_device_mesh(_device_type(device_type), experts, mesh_dim_names=EXPERT_DIMS)


def _device_type(given: str | None) -> str:
    return given or ("cuda" if torch.cuda.is_available() else "cpu")


MESH_LAYOUTS = ("gtp_inner", "gtp_outer")


def dense_mesh(
    dp: int = 1,
    gtp: int = -1,
    tp: int = 1,
    device_type: str | None = None,
    layout: str = "gtp_inner",
) -> DeviceMesh:
    """The mesh of dims ("dp", "gtp", "tp") over the whole world, GTPWrap's `mesh`. Each size
    a whole number, or -1 (one of them at most) for what the others leave of the world; dims of
    size 1 other than "gtp" are left out. tp groups are runs of consecutive ranks (one node's
    NVLink under torchrun). `layout` places the rest:

    - "gtp_inner": each gtp group a run of consecutive ranks (`init_device_mesh`'s row-major
      order); dp crosses the runs. Gathers stay on a node's links.
    - "gtp_outer": the dp groups inside the runs (each dp x tp block a run of consecutive
      ranks) and the gtp groups strided across them, for weights sharded over more GPUs than
      a node has.

    The README's "Which mesh axis on which link" says which to use and why."""
    if not dist.is_initialized():
        raise WrapError("make_mesh needs torch.distributed: call dist.init_process_group() first")
    world = dist.get_world_size()
    call = f"the dense mesh dp={dp}, gtp={gtp}, tp={tp}"
    if layout not in MESH_LAYOUTS:
        raise WrapError(f"{call}: layout={layout!r} is not one of {', '.join(MESH_LAYOUTS)}")
    sizes = {DP: dp, GTP: gtp, TP: tp}
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1 or any(size < 1 and size != -1 for size in sizes.values()):
        raise WrapError(
            f"{call}: give each size as a whole number >= 1, or -1 for one of dp, gtp and tp "
            "(what the others leave of the world)"
        )
    known = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        sizes[rest[0]] = world // known if world % known == 0 else 0
    if math.prod(sizes.values()) != world:
        raise WrapError(
            f"{call} does not fill the world of {world} ranks: dp x gtp x tp must equal the "
            "world size"
        )
    # On the CPU whatever the default device, as init_device_mesh makes it (a model built
    # under torch.device("meta") is where a mesh is often made).
    everyone = torch.arange(world, device="cpu")
    ranks = everyone.view(sizes[DP], sizes[GTP], sizes[TP])
    if layout == "gtp_outer":
        ranks = everyone.view(sizes[GTP], sizes[DP], sizes[TP]).transpose(0, 1)
    kept = [i for i, name in enumerate(MESH_DIMS) if name == GTP or sizes[name] > 1]
    ranks = ranks.reshape([sizes[MESH_DIMS[i]] for i in kept])
    names = tuple(MESH_DIMS[i] for i in kept)
    return DeviceMesh(_device_type(device_type), ranks, mesh_dim_names=names)


def _axis(mesh: DeviceMesh, name: str) -> MeshAxis:
    dim = (mesh.mesh_dim_names or ()).index(name)
    return MeshAxis(name, mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim))


def _single(name: str) -> MeshAxis:
    return MeshAxis(name, None, 0, 1)


def resolve_mesh(
    mesh: DeviceMesh | dist.ProcessGroup | None,
    device: torch.device,
    expert_mesh: DeviceMesh | None = None,
    experts: bool = False,
) -> GTPMesh:
    """Validate `mesh` (and `expert_mesh`) against the world and return their roles; no
    collective is issued here. With `experts` (the policy places expert stacks) and no
    `expert_mesh`, the whole world is one egtp group, as it is one gtp group without `mesh`."""
    dense = _resolve_dense(mesh, device)
    if expert_mesh is None and experts and dense.device_mesh is not None:
        expert_mesh = init_device_mesh(device.type, (dense.world_size,), mesh_dim_names=(EGTP,))
    if expert_mesh is None:
        return dense
    if dense.device_mesh is None:
        raise WrapError(
            "an expert_mesh was given but torch.distributed is not initialized; call "
            "dist.init_process_group() first"
        )
    names = tuple(expert_mesh.mesh_dim_names or ()) if isinstance(expert_mesh, DeviceMesh) else ()
    if not names or list(names) != [n for n in EXPERT_DIMS if n in names]:
        raise WrapError(
            f"expert_mesh must be a DeviceMesh with dims named from {EXPERT_DIMS}, in that "
            f"order, got {expert_mesh!r}; gtp_wrap.make_mesh(ep=..., egtp=...) builds one"
        )
    if expert_mesh.size() != dense.world_size or expert_mesh.device_type != device.type:
        raise WrapError(
            f"expert_mesh spans {expert_mesh.size()} ranks on '{expert_mesh.device_type}', but "
            f"the world has {dense.world_size} on '{device.type}': it must factor the whole "
            "world on the parameters' device, as the dense mesh does"
        )
    if dense.tp.size > 1:
        raise WrapError(
            "an expert_mesh beside a tp dim is not supported yet: the tp ranks of a dense layer "
            "read one batch, and expert parallelism over them would count its tokens tp times; "
            "leave tp out of the mesh (tp=1) when giving an expert_mesh"
        )
    axes = {name: _axis(expert_mesh, name) for name in names}
    return dataclasses.replace(
        dense,
        expert_mesh=expert_mesh,
        egtp=axes.get(EGTP, _single(EGTP)),
        ep=axes.get(EP, _single(EP)),
        edp=axes.get(EDP, _single(EDP)),
    )


def _resolve_dense(mesh: DeviceMesh | dist.ProcessGroup | None, device: torch.device) -> GTPMesh:
    if not dist.is_initialized():
        if mesh is not None:
            raise WrapError(
                "a mesh was given but torch.distributed is not initialized; call "
                "dist.init_process_group() first (torchrun sets the environment it needs)"
            )
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1:  # else every rank would train a model of its own, silently
            raise WrapError(
                f"this process was launched as one of WORLD_SIZE={launched} ranks, but "
                "torch.distributed is not initialized; call dist.init_process_group() before "
                "GTPWrap"
            )
        alone = _single("world")
        return GTPMesh(None, _single(GTP), _single(DP), _single(TP), alone, alone)

    world = dist.get_world_size()
    if mesh is None:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=(GTP,))
    elif isinstance(mesh, dist.ProcessGroup):
        mesh = DeviceMesh.from_group(mesh, device.type, mesh_dim_names=(GTP,))
    if not isinstance(mesh, DeviceMesh):
        raise WrapError(f"mesh must be a DeviceMesh or ProcessGroup, got {type(mesh).__name__}")
    if mesh.size() != world:
        raise WrapError(
            f"the mesh spans {mesh.size()} ranks but the world has {world}; GTP treats every "
            f"rank as a data rank, so give a mesh over the whole world (dims from {MESH_DIMS})"
        )
    if mesh.device_type != device.type:
        raise WrapError(
            f"the mesh is on '{mesh.device_type}' but the parameters are on '{device.type}'; "
            "move the model to the mesh's device before wrapping"
        )
    everyone = MeshAxis("world", None, dist.get_rank(), world)
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        gtp = MeshAxis(GTP, mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0))
        return GTPMesh(mesh, gtp, _single(DP), _single(TP), everyone, everyone)
    if GTP not in names or list(names) != [n for n in MESH_DIMS if n in names]:
        raise WrapError(
            f"a mesh of {mesh.ndim} dims named {mesh.mesh_dim_names} is not supported: name "
            f"its dims from {MESH_DIMS}, in that order (tp innermost), including 'gtp'; "
            "gtp_wrap.make_mesh(dp=..., gtp=..., tp=...) builds one"
        )
    gtp, dp, tp = _axis(mesh, GTP), _single(DP), _single(TP)
    if DP in names:
        dp = _axis(mesh, DP)
    if TP not in names:
        return GTPMesh(mesh, gtp, dp, tp, everyone, everyone)
    tp, tp_mesh = _axis(mesh, TP), mesh[TP]
    if tp.size == 1:
        return GTPMesh(mesh, gtp, dp, tp, everyone, everyone, tp_mesh)
    if DP not in names or dp.size == 1:
        data = dataclasses.replace(gtp, name="data")
    else:  # the dp x gtp ranks of this rank's tp coordinate, as one group
        flat = mesh[DP, GTP]._flatten("dp_gtp")
        data = MeshAxis("data", flat.get_group(0), flat.get_local_rank(0), flat.size(0))
    return GTPMesh(mesh, gtp, dp, tp, data, everyone, tp_mesh)
