"""ZeRO stages 1-3 over MPI, and bf16 mixed precision (Rajbhandari et al., SC'20).

Parameters are grouped into buckets (reverse registration order, as data parallelism
does; for stage 3 one bucket per transformer block plus one for the embeddings and final
LayerNorm). Each bucket is one flat buffer padded to a multiple of the N data-parallel
ranks; rank r owns the slice ``[r*s, (r+1)*s)`` (``shards.shard_layout``).

What each rank keeps, per stage (compute dtype c = fp32 or bf16; gradients, fp32 master
weights and Adam moments are fp32 in either dtype, as Megatron's "main gradients"):

    stage  parameters          gradients            master + Adam moments
    0      full (c)            full (fp32)          full        (bf16 only; fp32 uses DataParallel)
    1      full (c)            full (fp32)          shard
    2      full (c)            shard (fp32)         shard
    3      shard (c)           shard (fp32)         shard

A step: backward produces gradients (in bf16 autograd's gradient of one parameter is bf16
and lives only until its hook has added it into the fp32 buffer); when a bucket's last
gradient arrives its reduction starts (nonblocking, in bucket order on every rank):
``Iallreduce`` for stage 0, ``Ireduce_scatter_block`` otherwise, always on fp32 data.
Stages 0 and 1 accumulate micro-batches in their fp32 gradient buffer and reduce it in
place once; stages 2 and 3 keep no full gradient, so they up-cast each micro-batch's
gradients into an fp32 staging buffer, reduce-scatter it and add the result to the fp32
gradient shard. The optimizer reads the fp32 gradient: nothing is rounded back to bf16.
With one data-parallel rank no reduction is started (nor allgather of stages 1-2). Then the
global gradient norm is summed over the shards, each rank clips and updates its shard
with AdamW, and stages 1 and 2 allgather the new parameters. Stage 3 allgathers a
block's parameters right before its forward and again before its backward, frees them
afterwards, and starts the next block's gather before the current block computes.
Parameter gathers use their own communicator, so they never interleave with gradient
reductions on the same one.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from mpi4py import MPI

from hpctrain.comm.buffers import MPIBuffer, to_mpi_all
from hpctrain.comm.resources import MPIResources
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import World
from hpctrain.parallel.bucketing import BucketScheduler, plan_buckets
from hpctrain.parallel.engine import (STATE_KEYS, BucketShard, EngineState, finish_norm,
                                      nothing_to_gather)
from hpctrain.parallel.memory import MemoryReport, tensor_bytes
from hpctrain.parallel.shards import shard_layout
from hpctrain.profiling import profile_range
from hpctrain.parallel.optim import build_optimizer, clip_coefficient

MiB = 1 << 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ALIGN = 16  # shard length multiple: 64-byte aligned fp32 shards for vector kernels


def pack_flat(layout, tensors, device=None) -> torch.Tensor:
    """``tensors`` laid back to back in one zero-padded fp32 buffer of ``layout.padded``."""
    flat = torch.zeros(layout.padded, dtype=torch.float32, device=device)
    for t, off in zip(tensors, layout.offsets):
        flat[off:off + t.numel()] = t.detach().reshape(-1)
    return flat


def _broadcast_module(model: torch.nn.Module, world: World, root: int = 0) -> None:
    if world.size == 1:
        return
    bufs = [MPIBuffer(p.data, world.accel, world.gpu_aware) for p in model.parameters()]
    objs = to_mpi_all(bufs, send=world.rank == root)
    reqs = [world.comm.Ibcast(obj, root=root) for obj in objs]
    wait_all(reqs, timeout=world.timeout, what="broadcast of the initial parameters")
    for buf in bufs:
        buf.from_mpi()


def _empty_storage(t: torch.Tensor) -> None:
    try:
        t.untyped_storage().resize_(0)
    except RuntimeError as e:  # torch pins storage that a numpy array views
        raise RuntimeError("cannot free a gathered ZeRO-3 parameter buffer: something holds "
                           "a numpy view of a parameter (p.numpy()); copy it first "
                           "(p.detach().clone().numpy())") from e


def _fill_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def zero_buckets(model, stage: int, blocks, bucket_mb: float, first_bucket_mb: float
                 ) -> list[list[torch.nn.Parameter]]:
    """The parameters of each ZeRO bucket, in reduction order (also what ``ckpt reshard``
    lays a checkpoint out by). Stages 0-2: capped buckets in reverse registration order;
    stage 3: one per block (the unit it gathers), then everything else."""
    params = [p for p in model.parameters() if p.requires_grad]
    if stage < 3:
        order = params[::-1]
        plan = plan_buckets([p.numel() for p in order], 4, int(bucket_mb * MiB),
                            int(first_bucket_mb * MiB))
        return [[order[j] for j in g] for g in plan]
    if not blocks:
        raise ValueError("ZeRO-3 needs the model's blocks (the units it gathers)")
    # One unit per block, in backward order, then everything else (embeddings, final
    # LayerNorm), whose last gradient (the tied embedding) arrives at the very end.
    in_blocks = {id(p) for blk in blocks for p in blk.parameters()}
    units = [[p for p in blk.parameters() if p.requires_grad] for blk in reversed(blocks)]
    return units + [[p for p in params if id(p) not in in_blocks]]


class StagingPool:
    """fp32 buffers that stages 2-3 up-cast and reduce-scatter a bucket's gradients in,
    drawn from a byte budget and reused across buckets and steps.

    A buffer is reused only by a bucket of the same length, so with the default budget
    (every staged bucket's bytes) each bucket can be in flight at once and a hook never
    waits for a reduction to free a buffer. A smaller budget bounds the memory: ``take``
    then says no and the caller completes an old reduction first."""

    def __init__(self, budget: int, device, world: World):
        self.budget, self.device, self.world = budget, device, world
        self.free: dict[int, list[torch.Tensor]] = {}
        self.all: list[torch.Tensor] = []
        self._mpi: dict[int, MPIBuffer] = {}
        self.refusals = 0
        """Times a bucket found the budget spent (and a reduction had to finish first)."""

    def take(self, numel: int, force: bool = False) -> tuple[torch.Tensor, MPIBuffer] | None:
        """A zeroed buffer of ``numel`` and its MPI view; None if the budget is spent
        (``force``: allocate anyway, when nothing in flight could give one back)."""
        same = self.free.get(numel)
        if same:
            base = same.pop()
        else:
            need = numel * 4
            for n in sorted(self.free):  # idle buffers of other lengths make room
                while self.free[n] and self.nbytes + need > self.budget:
                    self._drop(self.free[n].pop())
            if self.nbytes + need > self.budget and not force:
                self.refusals += 1
                return None
            base = torch.empty(numel, dtype=torch.float32, device=self.device)
            self.all.append(base)
            self._mpi[id(base)] = MPIBuffer(base, self.world.accel, self.world.gpu_aware,
                                            reduction=True)
        base.zero_()
        return base, self._mpi[id(base)]

    def _drop(self, base: torch.Tensor) -> None:
        self.all = [b for b in self.all if b is not base]
        del self._mpi[id(base)]

    def release(self, base: torch.Tensor) -> None:
        self.free.setdefault(base.numel(), []).append(base)

    @property
    def nbytes(self) -> int:
        return sum(tensor_bytes(b) for b in self.all)


class ZeroBucket:
    """One flat group of parameters and its shard of gradients and optimizer state."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], *, stage: int,
                 rank: int, world: int, dtype: torch.dtype, comm_world: World):
        """``world``: data-parallel ranks; at 1 nothing is reduced (gradients are added
        straight into the fp32 gradient buffer or shard)."""
        self.index, self.params, self.stage, self.dtype = index, params, stage, dtype
        self.world = comm_world
        self.layout = shard_layout([p.numel() for p in params], world if stage else 1, ALIGN)
        self.rank = rank if stage else 0
        lo, hi = self.layout.rank_range(self.rank)
        device = params[0].device
        lay = self.layout
        with torch.no_grad():
            master_full = pack_flat(lay, params, device)
            # Parameters in the compute dtype: every p.data becomes a view of `full`.
            self.full = master_full.to(dtype) if dtype != torch.float32 else master_full
            for p, off in zip(params, lay.offsets):
                p.data = self.full[off:off + p.numel()].view(p.shape)
            if dtype == torch.float32 and stage < 3:
                self.master = self.full[lo:hi]  # updated in place, then allgathered
            else:
                self.master = master_full[lo:hi].clone()
            self.shard = None  # stage 3: this rank's compute-dtype parameter shard
            if stage == 3:
                self.shard = self.master if dtype == torch.float32 else self.full[lo:hi].clone()
                _empty_storage(self.full)
        del master_full
        self.local = world == 1
        # fp32 gradients in either compute dtype ("main gradients"): micro-batches add up
        # and reduce in fp32, and the optimizer reads them as they are.
        if stage <= 1:
            self.grad_full = torch.zeros(lay.padded, dtype=torch.float32, device=device)
            self.grad_shard = self.grad_full[:lay.shard]  # in-place reduce-scatter lands here
        else:
            self.grad_full = None
            self.grad_shard = torch.zeros(lay.shard, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(lay.shard, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(lay.shard, dtype=torch.float32, device=device)
        self.bind_grads()
        self.slot = {id(p): i for i, p in enumerate(params)}
        # fp32 ZeRO-3 reduces gradients inside the gathered parameter buffer (see
        # Zero._stage_grad); `got` marks which parameters' slices hold a gradient.
        self.grads_in_full = stage == 3 and dtype == torch.float32 and not self.local
        self.got = [False] * len(params)
        # Scheduling state for one backward.
        self.pending = len(params)
        self.staging: torch.Tensor | None = None
        self.staging_mpi: MPIBuffer | None = None
        self.mpi: MPIBuffer | None = None  # what this backward's reduction hands to MPI
        w = comm_world
        self.grad_mpi = MPIBuffer(self.grad_full, w.accel, w.gpu_aware, reduction=True) \
            if self.reduces_in_place() and not self.local else None
        self.shard_mpi = MPIBuffer(self.shard, w.accel, w.gpu_aware, raw=True) \
            if stage == 3 else None
        # Stage 3 gather state: 'free' | 'gathering' | 'ready'.
        self.gather_state = "free" if stage == 3 else "ready"
        self.gather_request: MPI.Request | None = None
        self._full_mpi: dict[bool, MPIBuffer] = {}

    @property
    def nbytes(self) -> int:
        return self.layout.padded * 4

    def bind_grads(self) -> None:
        """fp32 stages 0-1: autograd accumulates into views of the gradient buffer; else
        each gradient is autograd's own tensor until the hook takes it."""
        bind = self.grad_full is not None and self.dtype == torch.float32
        for p, off in zip(self.params, self.layout.offsets):
            p.grad = self.grad_full[off:off + p.numel()].view(p.shape) if bind else None

    def reduces_in_place(self) -> bool:
        """Stages 0-1 reduce the fp32 gradient buffer itself; 2-3 stage in fp32."""
        return self.grad_full is not None

    def full_mpi(self, reduction: bool = False) -> MPIBuffer:
        """MPI view of ``full`` (host memory by address and byte count: stage 3
        re-allocates it), for gathers or (``reduction``) fp32 ZeRO-3's reductions."""
        if reduction not in self._full_mpi:
            self._full_mpi[reduction] = MPIBuffer(self.full, self.world.accel,
                                                  self.world.gpu_aware, raw=True,
                                                  reduction=reduction)
        return self._full_mpi[reduction]


class Zero(BucketScheduler):
    """ZeRO-``stage`` data parallelism with its own sharded AdamW."""

    def __init__(self, model: torch.nn.Module, world: World, optim_cfg, *, stage: int,
                 dtype: str = "fp32", bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 blocks: list[torch.nn.Module] | None = None, norm_comms: tuple = (),
                 staging_mb: float | None = None):
        """``blocks``: the units ZeRO-3 gathers (the transformer blocks); ``norm_comms``:
        see engine.py; ``staging_mb``: the byte budget of stages 2-3's fp32 reduction
        buffers (default: every bucket's, so all can be in flight at once)."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0-3, not {stage}")
        self.model, self.world, self.stage = model, world, stage
        # The norm's squares are summed over the shards' ranks (stages 1-3), then these.
        self.norm_comms = ([world.comm] if stage else []) + list(norm_comms)
        self.dtype = DTYPES[dtype]
        self.optim_cfg = optim_cfg
        self.comm = world.comm
        self.resources = MPIResources()
        self.gather_comm = self.resources.add(world.comm.Dup()) if stage == 3 else None
        self.size, self.rank = world.size, world.rank
        _broadcast_module(model, world)  # every rank starts from rank 0's initialization
        groups = zero_buckets(model, stage, blocks, bucket_mb, first_bucket_mb)
        self.buckets = [ZeroBucket(i, g, stage=stage, rank=self.rank, world=self.size,
                                   dtype=self.dtype, comm_world=world)
                        for i, g in enumerate(groups)]
        self.local = self.size == 1  # nothing to reduce or share: no MPI reduction
        device = self.buckets[0].full.device
        staged = [b.layout.padded * 4 for b in self.buckets
                  if not (b.local or b.reduces_in_place() or b.grads_in_full)]
        budget = sum(staged) if staging_mb is None else int(staging_mb * MiB)
        self.staging = StagingPool(budget, device, world)
        self.optimizers = [self._optimizer(b) for b in self.buckets]
        super().__init__(self.buckets, timeout=world.timeout)
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, b))
        self._pinned = False
        self._open = False  # a synced backward whose reductions finish() has not completed
        self.gathered_bytes = self.peak_gathered_bytes = 0  # ZeRO-3 full parameters held
        if stage == 3:
            self._install_gather_hooks(model, blocks)

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
        # Stages 2 and 3 keep no full gradient, so every micro-batch is reduced (and the
        # previous micro-batch's reductions are completed before the next backward).
        sync = last_micro
        if self.stage >= 2:
            if self._open:
                self.finish()
            sync = True
        self._open = sync
        super().prepare_for_backward(sync)

    def _on_grad(self, bucket: ZeroBucket, param: torch.nn.Parameter) -> None:
        if self.stage >= 2:
            self._stage_grad(bucket, param)
        elif self.dtype != torch.float32:
            self._add_to_main_grad(bucket, param)
        self.grad_ready(bucket)
        if self.stage == 3 and bucket.pending == 0 and not bucket.grads_in_full:
            self._release(bucket)  # its backward is done: free the gathered parameters

    def _add_to_main_grad(self, b: ZeroBucket, p: torch.nn.Parameter) -> None:
        """bf16 stages 0-1: add autograd's bf16 gradient into the fp32 gradient buffer
        (every micro-batch), drop it."""
        off = b.layout.offsets[b.slot[id(p)]]
        b.grad_full[off:off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None

    def _stage_grad(self, b: ZeroBucket, p: torch.nn.Parameter) -> None:
        """Stages 2-3: move a fresh gradient into the bucket's reduction buffer (at one
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
            self._gather(b, wait=True)  # (only if no gradient at all arrived)
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

    def launch(self, b: ZeroBucket) -> MPI.Request:
        if b.mpi is None:  # one rank: no reduction
            return MPI.REQUEST_NULL
        buf = b.mpi.to_mpi()
        self.stats.reductions += 1
        self.stats.bytes_reduced += b.nbytes
        with profile_range(f"reduce bucket {b.index}"):
            if self.stage == 0:
                return self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            # In place: the input is the whole buffer, this rank's reduced shard lands
            # at its start (MPI standard, MPI_Reduce_scatter_block with MPI_IN_PLACE).
            return self.comm.Ireduce_scatter_block(MPI.IN_PLACE, buf, op=MPI.SUM)

    def complete(self, b: ZeroBucket) -> None:
        if b.mpi is None:
            return
        b.mpi.from_mpi()
        b.mpi = None
        if b.grads_in_full:
            b.grad_shard.add_(b.full[:b.layout.shard])
            b.got = [False] * len(b.params)
            self._release(b)
            return
        if b.staging is None:  # stages 0-1 reduced their fp32 gradient buffer in place
            return
        b.grad_shard.add_(b.staging[:b.layout.shard])
        self.staging.release(b.staging)
        b.staging = b.staging_mpi = None

    def finish(self) -> None:
        self._open = False
        super().finish()
        if self.stage == 3 and not self._pinned:
            for b in self.buckets:
                self._release(b)

    def zero_grad(self) -> None:
        for b in self.buckets:
            (b.grad_full if b.grad_full is not None else b.grad_shard).zero_()
            b.bind_grads()

    # --------------------------------------------------------------- optimizer
    def grad_norm(self) -> float:
        """L2 norm of the whole (averaged) gradient, summed over every rank's shards (and
        the ``norm_comms``)."""
        local = sum(float(torch.linalg.vector_norm(b.grad_shard, dtype=torch.float32)) ** 2
                    for b in self.buckets)
        return finish_norm(local, self.norm_comms, self.world.timeout)

    def step(self, lr: float, max_norm: float) -> float:
        """Global norm; clip to ``max_norm`` (0: no clipping), update the shards, share the
        parameters, unless the norm is NaN or inf. Returns the norm."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return norm
        coef = clip_coefficient(norm, max_norm) if max_norm > 0 else 1.0
        with profile_range("optimizer"), torch.no_grad():
            for b, opt in zip(self.buckets, self.optimizers):
                grad = b.grad_shard  # fp32: what the optimizer's views read
                if coef != 1.0:
                    grad.mul_(coef)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
                if self.dtype != torch.float32:
                    self._publish_master(b)
        if self.stage in (1, 2) and not self.local:
            self._allgather_parameters()
        return norm

    def _publish_master(self, b: ZeroBucket) -> None:
        """bf16: round the updated fp32 master shard into the compute parameters."""
        lo, hi = b.layout.rank_range(b.rank)
        if self.stage == 3:
            b.shard.copy_(b.master)
        else:
            b.full[lo:hi].copy_(b.master)

    def _allgather_parameters(self) -> None:
        with profile_range("allgather parameters"):
            # In place: each rank's updated slice already sits at its own offset.
            objs = to_mpi_all([b.full_mpi() for b in self.buckets])
            reqs = [self.comm.Iallgather(MPI.IN_PLACE, obj) for obj in objs]
            wait_all(reqs, timeout=self.world.timeout, what="parameter allgather after the "
                     "optimizer step")
        for b in self.buckets:
            b.full_mpi().from_mpi()
        self.stats.gathers += len(reqs)

    # ---------------------------------------------------------- stage 3 gathers
    def _install_gather_hooks(self, model, blocks) -> None:
        n = len(blocks)
        by_block = {i: self.buckets[n - 1 - i] for i in range(n)}  # buckets are reversed
        outer = self.buckets[-1]
        self._block_bucket = by_block

        def root_pre(_module, _args):
            self._gather(outer, wait=True)
            self._gather(by_block[0], wait=False)  # prefetch

        def root_post(_module, _args, _output):
            if torch.is_grad_enabled():
                self._gather(by_block[n - 1], wait=False)  # backward starts with it
            else:
                self._release(outer)

        def block_pre(i, _module, _args):
            self._gather(by_block[i], wait=True)
            if i + 1 < n:
                self._gather(by_block[i + 1], wait=False)

        def block_post(i, _module, _args, output):
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(lambda grad: self._before_backward(i))
            self._release(by_block[i])

        model.register_forward_pre_hook(root_pre)
        model.register_forward_hook(root_post)
        for i, blk in enumerate(blocks):
            blk.register_forward_pre_hook(functools.partial(block_pre, i))
            blk.register_forward_hook(functools.partial(block_post, i))

    def _before_backward(self, i: int) -> None:
        self._gather(self._block_bucket[i], wait=True)
        if i > 0:
            self._gather(self._block_bucket[i - 1], wait=False)

    def _gather(self, b: ZeroBucket, *, wait: bool) -> None:
        if b.gather_state == "free":
            _fill_storage(b.full)
            self.gathered_bytes += tensor_bytes(b.full)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
            b.shard_mpi.prepare()
            b.full_mpi().prepare(send=False)  # only written: nothing to stage
            send, recv = to_mpi_all([b.shard_mpi, b.full_mpi()])
            b.gather_request = self.gather_comm.Iallgather(send, recv)
            b.gather_state = "gathering"
            self.stats.gathers += 1
        if wait and b.gather_state == "gathering":
            wait_all([b.gather_request], timeout=self.world.timeout,
                     what=f"ZeRO-3 parameter gather (bucket {b.index})")
            b.full_mpi().from_mpi()
            b.gather_state = "ready"

    def _release(self, b: ZeroBucket) -> None:
        if self.stage != 3 or self._pinned or b.gather_state == "free":
            return
        self._gather(b, wait=True)  # a prefetch still in flight must land first
        self.gathered_bytes -= tensor_bytes(b.full)
        _empty_storage(b.full)
        b.gather_state = "free"

    def gathered(self):
        """All parameters materialized on every rank (collective), e.g. to save or sample."""
        return self._gathered() if self.stage == 3 else nothing_to_gather(self.model)

    @contextlib.contextmanager
    def _gathered(self):
        for b in self.buckets:
            self._gather(b, wait=True)
        self._pinned = True
        try:
            yield self.model
        finally:
            self._pinned = False
            for b in self.buckets:
                self._release(b)

    # ---------------------------------------------------------- state and memory
    def consolidated_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full fp32 parameters and Adam moments per parameter, on every rank (collective).

        Keys are the parameters' names in the model; values hold ``param``, ``exp_avg``,
        ``exp_avg_sq`` and ``step``."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for b, opt in zip(self.buckets, self.optimizers):
            full = {}
            for key, shard in (("param", b.master), ("exp_avg", b.exp_avg),
                               ("exp_avg_sq", b.exp_avg_sq)):
                flat = torch.empty(b.layout.padded, dtype=torch.float32, device=shard.device)
                if b.layout.world == 1:
                    flat.copy_(shard)
                else:
                    w = self.world
                    src = MPIBuffer(shard.contiguous(), w.accel, w.gpu_aware)
                    dst = MPIBuffer(flat, w.accel, w.gpu_aware)
                    src.prepare()
                    dst.prepare(send=False)
                    wait_all([self.comm.Iallgather(*to_mpi_all([src, dst]))],
                             timeout=self.world.timeout, what="consolidating ZeRO state")
                    dst.from_mpi()
                full[key] = flat
            step = max((float(s["step"]) for s in opt.state.values()), default=0.0)
            for p, off in zip(b.params, b.layout.offsets):
                out[names[id(p)]] = {k: v[off:off + p.numel()].view(p.shape).clone()
                                     for k, v in full.items()}
                out[names[id(p)]]["step"] = torch.tensor(step)
        return out

    def optimizer_step(self) -> float:
        """Adam's step count (the same in every bucket's optimizer)."""
        return max((float(s["step"]) for opt in self.optimizers for s in opt.state.values()),
                   default=0.0)

    def load_full_state(self, full: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        """Take this rank's shards from whole per-parameter tensors (``param``,
        ``exp_avg``, ``exp_avg_sq`` by name), e.g. a checkpoint from another layout."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        with torch.no_grad():
            for b, opt in zip(self.buckets, self.optimizers):
                lo, hi = b.layout.rank_range(b.rank)
                mine = [full[names[id(p)]] for p in b.params]
                flat = {k: pack_flat(b.layout, [m[k] for m in mine])
                        for k in ("param", "exp_avg", "exp_avg_sq")}
                dev = b.master.device
                b.master.copy_(flat["param"][lo:hi].to(dev))
                b.exp_avg.copy_(flat["exp_avg"][lo:hi].to(dev))
                b.exp_avg_sq.copy_(flat["exp_avg_sq"][lo:hi].to(dev))
                if self.stage < 3:  # the compute parameters, whole
                    b.full.copy_(flat["param"].to(dev, self.dtype))
                elif b.shard is not b.master:
                    b.shard.copy_(b.master)
                for s in opt.state.values():
                    s["step"].fill_(step)

    def load_shards(self, shards: list[dict], step: float) -> None:
        """Take back this rank's own shards (``param``, ``exp_avg``, ``exp_avg_sq`` per
        bucket, as ``state_shards`` gave them) and share the parameters (collective)."""
        with torch.no_grad():
            for b, opt, s in zip(self.buckets, self.optimizers, shards):
                dev = b.master.device
                b.master.copy_(torch.from_numpy(s["param"]).to(dev))
                b.exp_avg.copy_(torch.from_numpy(s["exp_avg"]).to(dev))
                b.exp_avg_sq.copy_(torch.from_numpy(s["exp_avg_sq"]).to(dev))
                if self.dtype != torch.float32:
                    self._publish_master(b)
                for st in opt.state.values():
                    st["step"].fill_(step)
        if self.stage < 3 and self.size > 1:
            self._allgather_parameters()

    def state_shards(self) -> EngineState:
        """This rank's shards, bucket by bucket (what a sharded checkpoint saves)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return EngineState("zero", self.optimizer_step(), buckets=[
            BucketShard([names[id(p)] for p in b.params], [list(p.shape) for p in b.params],
                        b.layout, dict(zip(STATE_KEYS, (b.master, b.exp_avg, b.exp_avg_sq))))
            for b in self.buckets])

    def describe(self) -> str:
        return f"{len(self.buckets)} gradient bucket(s), ZeRO stage {self.stage}"

    def memory(self) -> MemoryReport:
        """Bytes this rank holds for model state, and its peak communication buffers."""
        params = grads = optim = 0
        for b in self.buckets:
            params += tensor_bytes(b.shard if self.stage == 3 else b.full)
            grads += tensor_bytes(b.grad_full if b.grad_full is not None else b.grad_shard)
            optim += tensor_bytes(b.exp_avg) + tensor_bytes(b.exp_avg_sq)
            if self.dtype != torch.float32:
                optim += tensor_bytes(b.master)  # bf16: the fp32 master is its own copy
        comm = self.staging.nbytes + self.peak_gathered_bytes
        return MemoryReport(params=params, grads=grads, optimizer=optim, comm_buffers=comm)

    def close(self) -> None:
        """Free the gather communicator (collective; idempotent). ``gathered()`` still
        works afterwards, on the reduction communicator: nothing reduces any more."""
        self.resources.close()
        if self.gather_comm is not None:
            self.gather_comm = self.comm
