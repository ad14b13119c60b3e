"""The ZeRO engine: levels 0-3 over MPI, fp32 or bf16 (Rajbhandari et al., SC'20).

What each rank keeps per level is in ``buckets.py``; ZeRO-3's parameter gathers are in
``gather.py``. This module moves gradients and updates the shards: a bucket's reduction
starts when its last gradient arrives, in bucket order on every rank (``Iallreduce`` at
level 0, ``Ireduce_scatter_block`` otherwise, always on fp32 data: nothing is rounded
back to bf16); levels 2 and 3 reduce-scatter every micro-batch. Then the global norm is
summed over the shards, each rank clips and updates its shard with AdamW, and levels 1
and 2 allgather the new parameters.
The step per level, and why fp32 gradients: docs/design/zero.md.
"""

from __future__ import annotations

import functools
import math

import torch

from hpctrain.comm.mpi import MPI
from hpctrain.comm.transport import Request
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import World
from hpctrain.parallel.bucketing import BucketScheduler
from hpctrain.parallel.engine import (finish_norm, local_norm_squares, norm_duplicates,
                                     nothing_to_gather)
from hpctrain.parallel.experts.apply import is_expert
from hpctrain.parallel.memory import STAGED_AT_ONCE, MemoryReport, tensor_bytes
from hpctrain.parallel.optim import build_optimizer, clip_coefficient
from hpctrain.parallel.tensor.split_state import TensorSplit
from hpctrain.parallel.zero.buckets import DTYPES, MiB, StagingPool, ZeroBucket, zero_buckets
from hpctrain.parallel.zero.gather import ParameterGather
from hpctrain.parallel.zero.state import ShardedState
from hpctrain.profiling import profile_range


def _broadcast_params(params: list[torch.nn.Parameter], world: World, root: int = 0) -> None:
    if world.size == 1 or not params:
        return
    bufs = [world.transport.buffer(p.data) for p in params]
    reqs = world.transport.broadcast_each(bufs, root)
    wait_all(reqs, timeout=world.timeout, what="broadcast of the initial parameters")
    for buf in bufs:
        buf.complete()



class Zero(ShardedState, BucketScheduler):
    """ZeRO-``level`` data parallelism with its own sharded AdamW."""

    state_kind = "zero"
    """The ``EngineState`` kind it saves: this rank's shards, bucket by bucket."""

    def __init__(self, model: torch.nn.Module, world: World, optim_cfg, *, level: int,
                 dtype: str = "fp32", bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 blocks: list[torch.nn.Module] | None = None, norm_comms: tuple = (),
                 tp_comm: MPI.Comm | None = None, staging_mb: float | None = None,
                 experts: World | None = None, ep_comm: MPI.Comm | None = None):
        """``blocks``: the units ZeRO-3 gathers (the transformer blocks); ``norm_comms``,
        ``tp_comm``, ``experts``, ``ep_comm``: see engine.py (the experts' buckets are
        reduced and sharded over ``experts``); ``staging_mb``: the byte budget of levels
        2-3's fp32 reduction buffers (default: ``STAGED_AT_ONCE`` of the largest staged bucket, or
        every staged bucket's bytes when that is less)."""
        if level not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO level must be 0-3, not {level}")
        self.model, self.world, self.level = model, world, level
        self.tensor_split = TensorSplit(model, tp_comm, world.timeout, ep_comm=ep_comm)
        self.experts = experts
        # The norm's squares are summed over the shards' ranks (levels 1-3), the
        # tensor-parallel group (or, replicated, the expert group), then these. Sharded,
        # the experts' shards over ``experts`` and the expert group make every expert once
        # over ``world``.
        self.copies_in_norm = self.tensor_split.size > 1 or (
            level == 0 and self.tensor_split.experts is not None)
        self.norm_comms = (([world.comm] if level else [])
                           + ([self.tensor_split.norm_comm] if self.copies_in_norm else [])
                           + list(norm_comms))
        self.dtype = DTYPES[dtype]
        self.optim_cfg = optim_cfg
        self.transport = world.transport
        self.gather_transport = world.transport.sibling() if level == 3 else None
        self.expert_gather = (experts.transport.sibling() if level == 3 and experts
                              else None)
        self.size, self.rank = world.size, world.rank
        expert = is_expert if experts is not None else None
        params = list(model.parameters())
        # Every rank starts from rank 0's initialization (experts: of their holders').
        _broadcast_params([p for p in params if not (expert and expert(p))], world)
        if expert:
            _broadcast_params([p for p in params if expert(p)], experts)
        groups = zero_buckets(model, level, blocks, bucket_mb, first_bucket_mb, expert)
        worlds = [experts if expert and expert(g[0]) else world for g in groups]
        self.buckets = [ZeroBucket(i, g, level=level, rank=w.rank, dp_size=w.size,
                                   dtype=self.dtype, world=w, expert=w is not world)
                        for i, (g, w) in enumerate(zip(groups, worlds))]
        self.local = self.size == 1  # nothing to reduce or share: no MPI reduction
        device = self.buckets[0].full.device
        staged = [b.layout.padded * 4 for b in self.buckets
                  if not (b.local or b.reduces_in_place() or b.grads_in_full)]
        budget = (min(sum(staged), STAGED_AT_ONCE * max(staged, default=0))
                  if staging_mb is None else int(staging_mb * MiB))
        self.staging = StagingPool(budget, device, world)
        self.optimizers = [self._optimizer(b) for b in self.buckets]
        super().__init__(self.buckets, timeout=world.timeout, clock=world.accel.clock)
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, b))
        self._open = False  # a synced backward whose reductions finish() has not completed
        self.gather = None
        if level == 3:
            self.gather = ParameterGather(self.buckets, self.gather_transport, world.timeout,
                                          self.stats, self.expert_gather)
            self.gather.install_hooks(model, blocks)

    def _optimizer(self, b: ZeroBucket) -> torch.optim.Optimizer:
        """The optimizer over this rank's pieces of ``b``; AdamW's state is the bucket's
        flat shards."""
        cfg = self.optim_cfg
        grad_source = b.grad_shard  # fp32 in either compute dtype
        decay, no_decay, state = [], [], {}
        for piece in b.layout.pieces(b.rank):
            a, z = piece.shard_start, piece.shard_start + piece.length
            view = torch.nn.Parameter(b.master[a:z], requires_grad=False)
            view.grad = grad_source[a:z]
            (decay if b.params[piece.index].dim() >= 2 else no_decay).append(view)
            state[view] = {"step": torch.zeros((), dtype=torch.float32, device=view.device),
                           "exp_avg": b.exp_avg[a:z], "exp_avg_sq": b.exp_avg_sq[a:z]}
        groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        if not groups:  # this rank owns only padding of this bucket
            groups = [{"params": [torch.nn.Parameter(b.master[:0], requires_grad=False)]}]
        opt = build_optimizer(groups, cfg)
        if isinstance(opt, torch.optim.AdamW):  # SGD keeps no state
            for view, s in state.items():
                opt.state[view] = s
        return opt

    # ------------------------------------------------------------- reductions
    @property
    def grad_scale(self) -> float:
        return 1.0 / self.size

    def prepare_for_backward(self, last_micro: bool) -> None:
        # Levels 2 and 3 keep no full gradient, so every micro-batch is reduced (and the
        # previous micro-batch's reductions are completed before the next backward).
        sync = last_micro
        if self.level >= 2:
            if self._open:
                self.finish()
            sync = True
        self._open = sync
        super().prepare_for_backward(sync)

    def _on_grad(self, bucket: ZeroBucket, param: torch.nn.Parameter) -> None:
        if self.level >= 2:
            self._stage_grad(bucket, param)
        elif self.dtype != torch.float32:
            self._add_to_main_grad(bucket, param)
        self.grad_ready(bucket)
        if self.level == 3 and bucket.pending == 0 and not bucket.grads_in_full:
            self._release(bucket)  # its backward is done: free the gathered parameters

    def _add_to_main_grad(self, b: ZeroBucket, p: torch.nn.Parameter) -> None:
        """bf16 levels 0-1: add autograd's bf16 gradient into the fp32 gradient buffer
        (every micro-batch), drop it."""
        off = b.layout.offsets[b.slot[id(p)]]
        b.grad_full[off:off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None

    def _stage_grad(self, b: ZeroBucket, p: torch.nn.Parameter) -> None:
        """Levels 2-3: move a fresh gradient into the bucket's reduction buffer (at one
        rank: add it to the gradient shard, which is the whole bucket), drop it."""
        i = b.slot[id(p)]
        off = b.layout.offsets[i]
        if b.local:
            b.grad_shard[off:off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
            return
        if b.grads_in_full:
            # fp32 ZeRO-3: autograd runs a parameter's accumulate-grad node after every
            # node that reads the parameter, so its slice of the gathered buffer is dead
            # now and can hold its gradient: the reduction needs no buffer of its own.
            dest = b.full
            b.got[i] = True
        else:
            if b.staging is None:
                b.staging, b.staging_mpi = self._acquire_staging(b)
            dest = b.staging
        dest[off:off + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None

    def _acquire_staging(self, b: ZeroBucket):
        got = self.staging.take(b.layout.padded)
        if got is None:  # only under a budget smaller than every bucket's
            self.poll()  # completed reductions give their buffers back
            while (got := self.staging.take(b.layout.padded)) is None and self.inflight:
                self.complete_oldest()  # bound the memory: wait rather than allocate more
            if got is None:
                got = self.staging.take(b.layout.padded, force=True)
        return got

    def bucket_ready(self, b: ZeroBucket) -> None:
        """Queue the device work that fills ``b``'s fp32 reduction buffer and record the
        event MPI waits for."""
        if b.local:
            b.mpi = None  # one rank: the gradients are already the sum
            return
        if b.reduces_in_place():
            b.mpi = b.grad_mpi
        elif b.grads_in_full:
            self.gather.gather(b, wait=True)  # (only if no gradient at all arrived)
            for i, got in enumerate(b.got):
                if not got:  # still holds the parameter: contribute a zero gradient
                    off = b.layout.offsets[i]
                    b.full[off:off + b.layout.numels[i]].zero_()
            b.full[b.layout.total:].zero_()
            b.mpi = b.full_mpi(reduction=True)
        else:
            if b.staging is None:
                b.staging, b.staging_mpi = self._acquire_staging(b)
            b.mpi = b.staging_mpi
        b.mpi.prepare()

    def can_launch(self, b: ZeroBucket) -> bool:
        return b.mpi is None or b.mpi.ready()

    def launch(self, b: ZeroBucket) -> Request:
        if b.mpi is None:  # one rank: no reduction
            return MPI.REQUEST_NULL
        self.stats.reductions += 1
        self.stats.bytes_reduced += b.nbytes
        with profile_range(f"reduce bucket {b.index}"):
            if self.level == 0:
                return b.world.transport.allreduce(b.mpi)
            # In place: the input is the whole buffer, this rank's reduced shard lands
            # at its start (MPI standard, MPI_Reduce_scatter_block with MPI_IN_PLACE).
            return b.world.transport.reduce_scatter(b.mpi)

    def complete(self, b: ZeroBucket) -> None:
        if b.mpi is None:
            return
        b.mpi.complete()
        b.mpi = None
        if b.grads_in_full:
            b.grad_shard.add_(b.full[:b.layout.shard])
            b.got = [False] * len(b.params)
            self._release(b)
            return
        if b.staging is None:  # levels 0-1 reduced their fp32 gradient buffer in place
            return
        b.grad_shard.add_(b.staging[:b.layout.shard])
        self.staging.release(b.staging)
        b.staging = b.staging_mpi = None

    def finish(self) -> None:
        self._open = False
        super().finish()
        if self.gather is not None:
            self.gather.release_all()

    def zero_grad(self) -> None:
        for b in self.buckets:
            (b.grad_full if b.grad_full is not None else b.grad_shard).zero_()
            b.bind_grads()

    # --------------------------------------------------------------- optimizer
    def grad_norm(self) -> float:
        """L2 norm of the whole (averaged) gradient, summed over every rank's shards (and
        the ``norm_comms``)."""
        whole, copies = [], 1
        if self.copies_in_norm:
            whole, copies = norm_duplicates(
                [(b.grad_shard[piece.shard_start:piece.shard_start + piece.length],
                  b.params[piece.index])
                 for b in self.buckets for piece in b.layout.pieces(b.rank)],
                self.tensor_split)
        local = local_norm_squares([b.grad_shard for b in self.buckets], whole, copies)
        return finish_norm(local, self.norm_comms, self.world.timeout)

    def step(self, lr: float, clip: float) -> float:
        """Global norm; clip to ``clip`` (0: no clipping), update the shards, share the
        parameters, unless the norm is NaN or inf. Returns the norm."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return norm
        coef = clip_coefficient(norm, clip) if clip > 0 else 1.0
        with profile_range("optimizer"), torch.no_grad():
            for b, opt in zip(self.buckets, self.optimizers):
                grad = b.grad_shard  # fp32: what the optimizer's views read
                if coef != 1.0:
                    grad.mul_(coef)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
                if self.dtype != torch.float32:
                    b.publish_master()
        if self.level in (1, 2) and not self.local:
            self.allgather_parameters()
        return norm

    def allgather_parameters(self) -> None:
        """Every rank's updated slice of the parameters to every rank (levels 0-2;
        collective over the data-parallel ranks)."""
        with profile_range("allgather parameters"):
            # In place: each rank's updated slice already sits at its own offset.
            shared = [b for b in self.buckets if not b.local]
            reqs = [r for w in {id(b.world): b.world for b in shared}.values()
                    for r in w.transport.allgather_each(
                        [b.full_mpi() for b in shared if b.world is w])]
            wait_all(reqs, timeout=self.world.timeout, what="parameter allgather after the "
                     "optimizer step")
        for b in shared:
            b.full_mpi().complete()
        self.stats.gathers += len(reqs)

    # ---------------------------------------------------------- level 3 gathers
    def _release(self, b: ZeroBucket) -> None:
        if self.gather is not None:
            self.gather.release(b)

    def gathered(self):
        """All parameters materialized on every rank (collective), e.g. to save or sample."""
        return self.gather.all_held(self.model) if self.gather else nothing_to_gather(self.model)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of ZeRO-3 full parameters held now (0 for other levels)."""
        return self.gather.gathered_bytes if self.gather else 0

    @property
    def peak_gathered_bytes(self) -> int:
        return self.gather.peak_gathered_bytes if self.gather else 0

    # ---------------------------------------------------------- memory and close
    def describe(self) -> str:
        experts = (f", experts reduced over {self.experts.size} rank(s)"
                   if self.experts is not None else "")
        return f"{len(self.buckets)} gradient bucket(s){experts}, ZeRO level {self.level}"

    def memory(self) -> MemoryReport:
        """Bytes this rank holds for model state, and its peak communication buffers."""
        params = grads = optim = 0
        for b in self.buckets:
            params += tensor_bytes(b.shard if self.level == 3 else b.full)
            grads += tensor_bytes(b.grad_full if b.grad_full is not None else b.grad_shard)
            optim += tensor_bytes(b.exp_avg) + tensor_bytes(b.exp_avg_sq)
            if self.dtype != torch.float32:
                optim += tensor_bytes(b.master)  # bf16: the fp32 master is its own copy
        comm = self.staging.nbytes + self.peak_gathered_bytes
        return MemoryReport(params=params, grads=grads, optimizer=optim, comm_buffers=comm)

    def close(self) -> None:
        """Free the gather channel (collective; idempotent). ``gathered()`` still works
        afterwards, on the reduction channel: nothing reduces any more."""
        if self.gather is not None and self.gather.transport is not self.transport:
            self.gather.transport.close()
            self.gather.transport = self.gather_transport = self.transport
            if self.expert_gather is not None:
                self.expert_gather.close()
                self.gather.expert_transport = self.expert_gather = self.experts.transport
