"""The process groups one GTP engine talks over.

Weights are sharded over the `gtp` mesh dim and replicated over `dp`. Every rank of the world
is a data-parallel rank, so gradients are averaged over `dp x gtp`.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import WrapError


@dataclasses.dataclass(frozen=True)
class GTPMesh:
    """Where the engine's collectives go. `device_mesh` is None when not distributed."""

    device_mesh: DeviceMesh | None
    gtp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    gtp_rank: int
    gtp_size: int
    dp_size: int

    @property
    def world_size(self) -> int:
        return self.gtp_size * self.dp_size

    @property
    def is_2d(self) -> bool:
        return self.dp_group is not None


def resolve_mesh(mesh: DeviceMesh | dist.ProcessGroup | None, device: torch.device) -> GTPMesh:
    """Validate `mesh` against the world and return its groups; no collective is issued here."""
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
        return GTPMesh(None, None, None, gtp_rank=0, gtp_size=1, dp_size=1)

    world = dist.get_world_size()
    if mesh is None:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("gtp",))
    elif isinstance(mesh, dist.ProcessGroup):
        mesh = DeviceMesh.from_group(mesh, device.type, mesh_dim_names=("gtp",))
    if not isinstance(mesh, DeviceMesh):
        raise WrapError(f"mesh must be a DeviceMesh or ProcessGroup, got {type(mesh).__name__}")
    if mesh.size() != world:
        raise WrapError(
            f"the mesh spans {mesh.size()} ranks but the world has {world}; GTP treats every "
            "rank as a data rank, so give a mesh over the whole world (e.g. 2-D ('dp', 'gtp'))"
        )
    if mesh.device_type != device.type:
        raise WrapError(
            f"the mesh is on '{mesh.device_type}' but the parameters are on '{device.type}'; "
            "move the model to the mesh's device before wrapping"
        )
    if mesh.ndim == 1:
        return GTPMesh(
            mesh,
            mesh.get_group(0),
            None,
            gtp_rank=mesh.get_local_rank(0),
            gtp_size=mesh.size(0),
            dp_size=1,
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names == ("dp", "gtp"):
        return GTPMesh(
            mesh,
            mesh.get_group("gtp"),
            mesh.get_group("dp"),
            gtp_rank=mesh.get_local_rank("gtp"),
            gtp_size=mesh.size(1),
            dp_size=mesh.size(0),
        )
    raise WrapError(
        f"a mesh of {mesh.ndim} dims named {mesh.mesh_dim_names} is not supported; use a 1-D "
        "mesh or a 2-D mesh with mesh_dim_names=('dp', 'gtp')"
    )
