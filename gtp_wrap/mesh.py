"""Named mesh roles: which process group each kind of collective of an engine runs over.

A `DeviceMesh` given to GTPWrap has its dims named from `MESH_DIMS` (any subset holding "gtp").
Each role is a `MeshAxis`: sharded weights are gathered and their gradients reduce-scattered
over `gtp`, those gradients are then averaged over `dp` (the replicate axis), and replicated
parameters are all-reduced over `world`, every data rank. Every rank of the world is a data
rank, so gradients are averaged over dp x gtp. This is the one place that knows the dims'
names; the engine and the state dicts ask it for groups and DTensor placements.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .errors import WrapError

DP, GTP = "dp", "gtp"
MESH_DIMS = (DP, GTP)  # outermost first


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
    world: MeshAxis  # every data rank: replicated parameters' gradients

    @property
    def world_size(self) -> int:
        return self.world.size

    def placements(self, dim: int) -> list[Placement]:
        """DTensor placements of a weight sharded along `dim`: one per mesh dim."""
        assert self.device_mesh is not None  # only distributed engines make DTensors
        if self.device_mesh.ndim == 1:  # the GTP group itself, whatever its dim is named
            return [Shard(dim)]
        names = self.device_mesh.mesh_dim_names or ()
        return [Shard(dim) if name == GTP else Replicate() for name in names]


def _axis(mesh: DeviceMesh, name: str) -> MeshAxis:
    dim = (mesh.mesh_dim_names or ()).index(name)
    return MeshAxis(name, mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim))


def _single(name: str) -> MeshAxis:
    return MeshAxis(name, None, 0, 1)


def resolve_mesh(mesh: DeviceMesh | dist.ProcessGroup | None, device: torch.device) -> GTPMesh:
    """Validate `mesh` against the world and return its roles; no collective is issued here."""
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
        return GTPMesh(None, _single(GTP), _single(DP), _single("world"))

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
            f"rank as a data rank, so give a mesh over the whole world (e.g. 2-D {MESH_DIMS})"
        )
    if mesh.device_type != device.type:
        raise WrapError(
            f"the mesh is on '{mesh.device_type}' but the parameters are on '{device.type}'; "
            "move the model to the mesh's device before wrapping"
        )
    everyone = MeshAxis("world", None, dist.get_rank(), world)
    if mesh.ndim == 1:
        gtp = MeshAxis(GTP, mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0))
        return GTPMesh(mesh, gtp, _single(DP), everyone)
    if mesh.ndim == 2 and mesh.mesh_dim_names == MESH_DIMS:
        return GTPMesh(mesh, _axis(mesh, GTP), _axis(mesh, DP), everyone)
    raise WrapError(
        f"a mesh of {mesh.ndim} dims named {mesh.mesh_dim_names} is not supported; use a 1-D "
        f"mesh or a 2-D mesh with mesh_dim_names={MESH_DIMS}"
    )
