"""The process grid: data-parallel x pipeline-parallel ranks and their communicators.

Rank r sits at pipeline stage ``r % pp`` of data-parallel replica ``r // pp`` by default,
so the ranks of one pipeline are consecutive and, with the usual block placement of
ranks on nodes, share a node: the frequent point-to-point activation traffic stays on
NVLink / shared memory while the once-per-step gradient reduction crosses nodes.
``pipeline_inner=False`` puts data-parallel replicas next to each other instead.

Built once (collective over the world) and passed to whatever needs it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from mpi4py import MPI

from hpctrain.comm.resources import MPIResources
from hpctrain.comm.transport import make_transport
from hpctrain.comm.world import World
from hpctrain.errors import UserError, factor_hint


class GridError(UserError):
    pass


def grid_coords(rank: int, dp: int, pp: int, pipeline_inner: bool = True) -> tuple[int, int]:
    """(data-parallel index, stage) of ``rank``."""
    return divmod(rank, pp) if pipeline_inner else (rank % dp, rank // dp)


def grid_rank(dp_index: int, stage: int, dp: int, pp: int, pipeline_inner: bool = True) -> int:
    return dp_index * pp + stage if pipeline_inner else stage * dp + dp_index


@dataclass(frozen=True, eq=False)
class ProcessGrid:
    world: World
    dp: int
    pp: int
    dp_index: int
    """This rank's data-parallel replica (0..dp-1)."""
    stage: int
    """This rank's pipeline stage (0..pp-1)."""
    dp_world: World
    """The ranks at this stage in every replica (gradient reductions, ZeRO shards)."""
    pp_comm: MPI.Comm
    """The ranks of this replica's pipeline, ranked by stage (activations, gradients)."""
    pipeline_inner: bool = True
    resources: MPIResources = dataclasses.field(default_factory=MPIResources)
    """The communicators the grid made (pp > 1); ``close()`` frees them."""

    @classmethod
    def create(cls, world: World, pp: int = 1, *, pipeline_inner: bool = True) -> "ProcessGrid":
        """Collective over ``world.comm``."""
        if pp < 1 or world.size % pp:
            raise GridError(f"{world.size} rank(s) cannot form pipelines of {pp} "
                            f"stage(s): {factor_hint(world.size, pp)}")
        dp = world.size // pp
        dp_index, stage = grid_coords(world.rank, dp, pp, pipeline_inner)
        resources = MPIResources()
        if pp == 1:
            dp_comm, pp_comm = world.comm, MPI.COMM_SELF
        else:
            dp_comm = resources.add(world.comm.Split(color=stage, key=dp_index))
            pp_comm = resources.add(world.comm.Split(color=dp_index, key=stage))
            if world.collectives == "xccl":
                _device_groups(world, dp, pp, pipeline_inner)
        dp_world = dataclasses.replace(world, comm=dp_comm, rank=dp_index, size=dp)
        return cls(world=world, dp=dp, pp=pp, dp_index=dp_index, stage=stage,
                   dp_world=dp_world, pp_comm=pp_comm, pipeline_inner=pipeline_inner,
                   resources=resources)

    @functools.cached_property
    def pp_transport(self):
        """How activations move between this replica's stages (``comm/transport.py``)."""
        return make_transport(self.world.collectives, self.pp_comm, self.world.accel,
                              self.world.gpu_aware)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    def stage_ranks(self, stage: int | None = None) -> list[int]:
        """World ranks holding ``stage`` (default: this rank's), in replica order."""
        stage = self.stage if stage is None else stage
        return [grid_rank(d, stage, self.dp, self.pp, self.pipeline_inner)
                for d in range(self.dp)]

    def describe(self) -> str:
        return f"dp={self.dp} x pp={self.pp} (replica {self.dp_index}, stage {self.stage})"

    def close(self) -> None:
        """Free the grid's communicators (collective; idempotent)."""
        self.resources.close()


def _device_groups(world: World, dp: int, pp: int, pipeline_inner: bool) -> None:
    """The device library's groups for every replica's pipeline and every stage's
    data-parallel set (with a second set for ZeRO-3's gathers), made by every rank in
    the same order (``device_collectives.make_groups``)."""
    from hpctrain.comm import device_collectives

    ranks = device_collectives.world_ranks(world.comm)
    at = [[ranks[grid_rank(d, s, dp, pp, pipeline_inner)] for s in range(pp)] for d in range(dp)]
    stage_sets = [[at[d][s] for d in range(dp)] for s in range(pp)] if dp > 1 else []
    device_collectives.make_groups(stage_sets, "reduce")
    device_collectives.make_groups(stage_sets, "gather")
    device_collectives.make_groups(at, "reduce")
