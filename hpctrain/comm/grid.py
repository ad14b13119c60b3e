"""The process grid: data-parallel x pipeline-parallel x context-parallel x
tensor-parallel ranks and their communicators.

The tensor-parallel ranks are innermost (adjacent, so with block placement on one node),
then the context-parallel ranks (one sequence's parts; a group may span nodes), then by
default the pipeline's stages of a replica, then the data-parallel replicas: the
frequent traffic stays near and the once-per-step gradient reduction crosses nodes
(``pipeline_inner=False`` puts replicas next to each other instead). The context-parallel
ranks hold the same parameters, so gradients are reduced (and ZeRO shards) over
dp x cp: ``dp_world``. Expert parallelism is drawn from the replicas: ``ep``
consecutive replicas form an expert group (``ep_comm``, each holding 1/ep of every MoE
layer's experts), and the replicas holding the same experts form ``expert_world``, over
which the experts' gradients are reduced. Built once
(collective over the world) and passed to whatever needs it.
The rank arithmetic and why: docs/design/training-step.md ("The grid and the next dimensions").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpctrain.comm.mpi import MPI
from hpctrain.comm.resources import MPIResources
from hpctrain.comm.world import World
from hpctrain.errors import UserError, factor_hint


class GridError(UserError):
    pass


def grid_coords(rank: int, dp: int, pp: int, pipeline_inner: bool = True,
                tp: int = 1, cp: int = 1) -> tuple[int, int, int]:
    """(data-parallel index, stage, tensor-parallel index) of ``rank``
    (``cp_coord`` gives its context-parallel index)."""
    outer, tp_index = divmod(rank, tp)
    outer //= cp
    dp_index, stage = divmod(outer, pp) if pipeline_inner else (outer % dp, outer // dp)
    return dp_index, stage, tp_index


def cp_coord(rank: int, tp: int = 1, cp: int = 1) -> int:
    """The context-parallel index of ``rank``: its place in its sequence's group."""
    return rank // tp % cp


def grid_rank(dp_index: int, stage: int, dp: int, pp: int, pipeline_inner: bool = True,
              tp: int = 1, tp_index: int = 0, cp: int = 1, cp_index: int = 0) -> int:
    outer = dp_index * pp + stage if pipeline_inner else stage * dp + dp_index
    return (outer * cp + cp_index) * tp + tp_index


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
    """The ranks holding the same parameters in every replica and context-parallel
    position: this stage and tensor-parallel position (gradient reductions, ZeRO
    shards); dp x cp ranks, ranked by (replica, context-parallel index)."""
    pp_comm: MPI.Comm
    """The ranks of this replica's pipeline at this tensor-parallel position, ranked by
    stage (activations, gradients)."""
    pipeline_inner: bool = True
    resources: MPIResources = dataclasses.field(default_factory=MPIResources)
    """The communicators the grid made; ``close()`` frees them."""
    tp: int = 1
    tp_index: int = 0
    """This rank's position in its tensor-parallel group (0..tp-1)."""
    tp_comm: MPI.Comm = dataclasses.field(default_factory=lambda: MPI.COMM_SELF)
    """The ranks that share each layer of this stage of this replica (adjacent ranks)."""
    cp: int = 1
    cp_index: int = 0
    """This rank's place in its context-parallel group (0..cp-1): which parts of each
    sequence it holds (``parallel/context/chunks.py``)."""
    cp_comm: MPI.Comm = dataclasses.field(default_factory=lambda: MPI.COMM_SELF)
    """The ranks that hold the parts of the same sequences at this stage and
    tensor-parallel position, ranked by ``cp_index`` (the ring of ring attention)."""
    ep: int = 1
    ep_index: int = 0
    """This rank's place in its expert group (0..ep-1): which slice of the experts it
    holds (``dp_index % ep``)."""
    ep_comm: MPI.Comm = dataclasses.field(default_factory=lambda: MPI.COMM_SELF)
    """The ep consecutive replicas (``dp_index // ep`` alike) whose experts together
    make every expert of a layer: the all-to-all of the tokens, ranked by ``ep_index``."""
    expert_world: World | None = None
    """The ranks holding the same experts (``dp_index % ep`` alike; dp x cp / ep of
    them): the experts' gradient reductions and ZeRO shards. ``dp_world`` when ep = 1."""

    @classmethod
    def create(cls, world: World, pp: int = 1, *, pipeline_inner: bool = True,
               tp: int = 1, cp: int = 1, ep: int = 1) -> "ProcessGrid":
        """Collective over ``world.comm``."""
        if tp < 1 or world.size % tp:
            raise GridError(f"{world.size} rank(s) cannot form tensor-parallel groups of "
                            f"{tp}: {factor_hint(world.size, tp, '--parallel.tp')}")
        if cp < 1 or (world.size // tp) % cp:
            hint = factor_hint(world.size // tp, cp, '--parallel.cp', group=tp)
            raise GridError(f"{world.size // tp} tensor-parallel group(s) cannot form "
                            f"context-parallel groups of {cp}: {hint}")
        if pp < 1 or (world.size // (tp * cp)) % pp:
            hint = factor_hint(world.size // (tp * cp), pp, group=tp * cp)
            raise GridError(f"{world.size // (tp * cp)} tensor x context-parallel group(s) "
                            f"cannot form pipelines of {pp} stage(s): {hint}")
        dp = world.size // (pp * cp * tp)
        if ep < 1 or dp % ep:
            raise GridError(f"{dp} data-parallel replica(s) cannot form expert-parallel "
                            f"groups of {ep}: --parallel.ep must divide them")
        dp_index, stage, tp_index = grid_coords(world.rank, dp, pp, pipeline_inner, tp, cp)
        cp_index = cp_coord(world.rank, tp, cp)
        replica = dp_index * cp + cp_index  # rank among the holders of the same parameters
        resources = MPIResources()
        dp_comm, pp_comm, tp_comm, cp_comm = (world.comm, MPI.COMM_SELF, MPI.COMM_SELF,
                                              MPI.COMM_SELF)
        if pp > 1 or tp > 1:
            dp_comm = resources.add(world.comm.Split(color=stage * tp + tp_index,
                                                     key=replica))
        if pp > 1:
            pp_comm = resources.add(world.comm.Split(color=replica * tp + tp_index,
                                                     key=stage))
        if cp > 1:
            cp_comm = resources.add(world.comm.Split(
                color=(dp_index * pp + stage) * tp + tp_index, key=cp_index))
        if tp > 1:
            tp_comm = resources.add(world.comm.Split(color=world.rank // tp, key=tp_index))
        if world.collectives == "xccl" and (pp > 1 or tp > 1 or cp > 1):
            _device_groups(world, dp, pp, tp, pipeline_inner, cp)
        if world.collectives == "xccl" and ep > 1:
            _expert_device_groups(world, dp, pp, tp, pipeline_inner, cp, ep)
        dp_world = dataclasses.replace(world, comm=dp_comm, rank=replica, size=dp * cp)
        ep_comm, expert_world = MPI.COMM_SELF, dp_world
        if ep > 1:
            group, ep_index = divmod(dp_index, ep)
            ep_comm = resources.add(dp_comm.Split(color=group * cp + cp_index, key=ep_index))
            same = resources.add(dp_comm.Split(color=ep_index, key=group * cp + cp_index))
            expert_world = dataclasses.replace(world, comm=same, rank=same.Get_rank(),
                                               size=same.Get_size())
        return cls(world=world, dp=dp, pp=pp, dp_index=dp_index, stage=stage,
                   dp_world=dp_world, pp_comm=pp_comm, pipeline_inner=pipeline_inner,
                   resources=resources, tp=tp, tp_index=tp_index, tp_comm=tp_comm,
                   cp=cp, cp_index=cp_index, cp_comm=cp_comm, ep=ep,
                   ep_index=dp_index % ep, ep_comm=ep_comm, expert_world=expert_world)

    @classmethod
    def of_config(cls, world: World, parallel) -> "ProcessGrid":
        """The grid of a run's parallel section (``--parallel.pp``, ``tp``, ``cp``, ``ep``)."""
        return cls.create(world, parallel.pp, tp=parallel.tp, cp=parallel.cp, ep=parallel.ep)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def loss_ranks(self) -> int:
        """Ranks that compute each replica's loss (its last stage's tensor-parallel
        and context-parallel ranks; each of the latter the mean over its own tokens, as
        many on every rank): the world's sum of losses over this is the batch's mean."""
        return self.dp * self.tp * self.cp

    def stage_ranks(self, stage: int | None = None) -> list[int]:
        """World ranks holding ``stage`` (default: this rank's) at this rank's
        tensor-parallel position, in ``dp_world``'s order (replica, then context-parallel
        index)."""
        stage = self.stage if stage is None else stage
        return [grid_rank(d, stage, self.dp, self.pp, self.pipeline_inner, self.tp,
                          self.tp_index, self.cp, c)
                for d in range(self.dp) for c in range(self.cp)]

    def expert_ranks(self) -> list[int]:
        """World ranks holding this rank's experts at its stage and tensor-parallel
        position, in ``expert_world``'s order (``stage_ranks`` when ep = 1)."""
        return [grid_rank(g * self.ep + self.ep_index, self.stage, self.dp, self.pp,
                          self.pipeline_inner, self.tp, self.tp_index, self.cp, c)
                for g in range(self.dp // self.ep) for c in range(self.cp)]

    def describe(self) -> str:
        tp = ((f" x cp={self.cp}" if self.cp > 1 else "")
              + (f" (ep={self.ep})" if self.ep > 1 else "")
              + (f" x tp={self.tp}" if self.tp > 1 else ""))
        where = (f", context rank {self.cp_index}" if self.cp > 1 else "") + (
            f", tensor rank {self.tp_index}" if self.tp > 1 else "")
        return (f"dp={self.dp} x pp={self.pp}{tp} (replica {self.dp_index}, stage "
                f"{self.stage}{where})")

    def close(self) -> None:
        """Free the grid's communicators (collective; idempotent)."""
        self.resources.close()


def _device_groups(world: World, dp: int, pp: int, tp: int, pipeline_inner: bool,
                   cp: int = 1) -> None:
    """The device library's groups, made by every rank in the same order
    (``device_collectives.make_groups``): every pipeline and every data-parallel set
    (with a second set for ZeRO-3's gathers), one of each per tensor-parallel position,
    the tensor-parallel groups, and the context-parallel rings (``parallel/context/ring.py``:
    their blocks go by the library's point-to-point)."""
    from hpctrain.comm import device_collectives

    ranks = device_collectives.world_ranks(world.comm)

    def at(d: int, s: int, t: int, c: int = 0) -> int:
        return ranks[grid_rank(d, s, dp, pp, pipeline_inner, tp, t, cp, c)]

    stage_sets = ([[at(d, s, t, c) for d in range(dp) for c in range(cp)]
                   for s in range(pp) for t in range(tp)] if dp * cp > 1 else [])
    device_collectives.make_groups(stage_sets, "reduce")
    device_collectives.make_groups(stage_sets, "gather")
    if pp > 1:
        device_collectives.make_groups(
            [[at(d, s, t, c) for s in range(pp)] for d in range(dp) for c in range(cp)
             for t in range(tp)], "reduce")
    if tp > 1:
        device_collectives.make_groups(
            [[at(d, s, t, c) for t in range(tp)] for d in range(dp) for s in range(pp)
             for c in range(cp)], "tensor")
    if cp > 1:
        device_collectives.make_groups(
            [[at(d, s, t, c) for c in range(cp)] for d in range(dp) for s in range(pp)
             for t in range(tp)], "ring")


def _expert_device_groups(world: World, dp: int, pp: int, tp: int, pipeline_inner: bool,
                          cp: int, ep: int) -> None:
    """The device library's groups of expert parallelism, made by every rank in the same
    order: the expert groups' all-to-all (``experts``) and the reductions and ZeRO-3
    gathers over the ranks holding the same experts."""
    from hpctrain.comm import device_collectives

    ranks = device_collectives.world_ranks(world.comm)

    def at(d: int, s: int, t: int, c: int) -> int:
        return ranks[grid_rank(d, s, dp, pp, pipeline_inner, tp, t, cp, c)]

    places = [(s, t, c) for s in range(pp) for t in range(tp) for c in range(cp)]
    device_collectives.make_groups(
        [[at(g * ep + e, s, t, c) for e in range(ep)]
         for s, t, c in places for g in range(dp // ep)], "experts")
    same = [[at(g * ep + e, s, t, c) for g in range(dp // ep) for c in range(cp)]
            for s in range(pp) for t in range(tp) for e in range(ep)]
    if dp // ep * cp > 1:
        device_collectives.make_groups(same, "reduce")
        device_collectives.make_groups(same, "gather")
