"""The storage layer of the ZeRO engine: flat buckets, their shards, staging buffers.

Parameters are grouped into buckets (``zero_buckets``: reverse registration order; at
level 3 one bucket per transformer block plus one for the embeddings and final norm).
Each bucket is one flat buffer padded to a multiple of the N data-parallel ranks; rank r
owns the slice ``[r*s, (r+1)*s)`` (``shards.shard_layout``). A ``ZeroBucket`` keeps full
or sharded parameters, fp32 gradients and fp32 master weights and moments as its level
says; levels 2 and 3 reduce-scatter through fp32 buffers from the ``StagingPool``.
Nothing here starts communication: the engine (``engine.py``) does.
What each level keeps, and why fp32 gradients: docs/design/zero.md.
"""

from __future__ import annotations

import torch

from hpctrain.comm.transport import CommBuffer
from hpctrain.comm.world import World
from hpctrain.parallel.bucketing import plan_buckets, split_by_kind
from hpctrain.parallel.memory import tensor_bytes
from hpctrain.parallel.shards import shard_layout
from hpctrain.sizes import MiB

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ALIGN = 16  # shard length multiple: 64-byte aligned fp32 shards for vector kernels


def pack_flat(layout, tensors, device=None) -> torch.Tensor:
    """``tensors`` laid back to back in one zero-padded fp32 buffer of ``layout.padded``."""
    flat = torch.zeros(layout.padded, dtype=torch.float32, device=device)
    for t, off in zip(tensors, layout.offsets):
        flat[off:off + t.numel()] = t.detach().reshape(-1)
    return flat


def free_storage(t: torch.Tensor) -> None:
    """Give ``t``'s memory back; ``t`` keeps its shape and views (ZeRO-3 frees a gathered
    bucket between uses)."""
    try:
        t.untyped_storage().resize_(0)
    except RuntimeError as e:  # torch pins storage that a numpy array views
        raise RuntimeError("cannot free a gathered ZeRO-3 parameter buffer: something holds "
                           "a numpy view of a parameter (p.numpy()); copy it first "
                           "(p.detach().clone().numpy())") from e


def refill_storage(t: torch.Tensor) -> None:
    """Allocate ``t``'s memory again (contents undefined) before a gather writes it."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


def zero_buckets(model, level: int, blocks, bucket_mb: float, first_bucket_mb: float,
                 expert=None) -> list[list[torch.nn.Parameter]]:
    """The parameters of each ZeRO bucket, in reduction order (also what ``ckpt reshard``
    lays a checkpoint out by). Levels 0-2: capped buckets in reverse registration order;
    level 3: one per block (the unit it gathers), then everything else. ``expert``: a
    predicate on parameters (expert parallelism) by which buckets are cut in two, as the
    experts are reduced and sharded over another group."""
    params = [p for p in model.parameters() if p.requires_grad]
    if level < 3:
        order = params[::-1]
        plan = plan_buckets([p.numel() for p in order], 4, int(bucket_mb * MiB),
                            int(first_bucket_mb * MiB))
        if expert is not None:
            plan = split_by_kind(plan, [expert(p) for p in order])
        return [[order[j] for j in g] for g in plan]
    if not blocks:
        raise ValueError("ZeRO-3 needs the model's blocks (the units it gathers)")
    # One unit per block, in backward order, then everything else (embeddings, final
    # LayerNorm), whose last gradient (the tied embedding) arrives at the very end.
    in_blocks = {id(p) for blk in blocks for p in blk.parameters()}
    units = [[p for p in blk.parameters() if p.requires_grad] for blk in reversed(blocks)]
    units = units + [[p for p in params if id(p) not in in_blocks]]
    if expert is None:
        return units
    return [[unit[j] for j in run] for unit in units
            for run in split_by_kind([list(range(len(unit)))], [expert(p) for p in unit])]


class StagingPool:
    """fp32 buffers that levels 2-3 up-cast and reduce-scatter a bucket's gradients in,
    drawn from a byte budget and reused across buckets and steps.

    A buffer is reused as it is only by a bucket of the same length; idle buffers of other
    lengths are dropped when a new one would pass the budget. When the budget is spent,
    ``take`` says no and the caller completes an old reduction first. The engine's
    default budget is ``STAGED_AT_ONCE`` of its largest bucket: a budget of every bucket
    would let the pool keep a buffer per bucket length, up to the whole gradient in fp32
    (``docs/design/zero.md``, "Memory at the cap")."""

    def __init__(self, budget: int, device, world: World):
        self.budget, self.device, self.world = budget, device, world
        self.free: dict[int, list[torch.Tensor]] = {}
        self.all: list[torch.Tensor] = []
        self._views: dict[int, CommBuffer] = {}
        self.refusals = 0
        """Times a bucket found the budget spent (and a reduction had to finish first)."""

    def take(self, numel: int, force: bool = False) -> tuple[torch.Tensor, CommBuffer] | None:
        """A zeroed buffer of ``numel`` and its transport view; None if the budget is spent
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
            self._views[id(base)] = self.world.transport.buffer(base, reduction=True)
        base.zero_()
        return base, self._views[id(base)]

    def _drop(self, base: torch.Tensor) -> None:
        self.all = [b for b in self.all if b is not base]
        del self._views[id(base)]

    def release(self, base: torch.Tensor) -> None:
        self.free.setdefault(base.numel(), []).append(base)

    @property
    def nbytes(self) -> int:
        return sum(tensor_bytes(b) for b in self.all)


class ZeroBucket:
    """One flat group of parameters and its shard of gradients and optimizer state."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], *, level: int,
                 rank: int, dp_size: int, dtype: torch.dtype, world: World,
                 expert: bool = False):
        """``dp_size``: data-parallel ranks; at 1 nothing is reduced (gradients are added
        straight into the fp32 gradient buffer or shard). ``world``: theirs (``expert``:
        the ranks holding the same experts)."""
        self.index, self.params, self.level, self.dtype = index, params, level, dtype
        self.world, self.expert = world, expert
        self.layout = shard_layout([p.numel() for p in params], dp_size if level else 1, ALIGN)
        self.rank = rank if level else 0
        lo, hi = self.layout.rank_range(self.rank)
        device = params[0].device
        lay = self.layout
        with torch.no_grad():
            master_full = pack_flat(lay, params, device)
            # Parameters in the compute dtype: every p.data becomes a view of `full`.
            self.full = master_full.to(dtype) if dtype != torch.float32 else master_full
            for p, off in zip(params, lay.offsets):
                p.data = self.full[off:off + p.numel()].view(p.shape)
            if dtype == torch.float32 and level < 3:
                self.master = self.full[lo:hi]  # updated in place, then allgathered
            else:
                self.master = master_full[lo:hi].clone()
            self.shard = None  # level 3: this rank's compute-dtype parameter shard
            if level == 3:
                self.shard = self.master if dtype == torch.float32 else self.full[lo:hi].clone()
                free_storage(self.full)
        del master_full
        self.local = dp_size == 1
        # fp32 gradients in either compute dtype ("main gradients"): micro-batches add up
        # and reduce in fp32, and the optimizer reads them as they are.
        if level <= 1:
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
        self.grads_in_full = level == 3 and dtype == torch.float32 and not self.local
        self.got = [False] * len(params)
        # Scheduling state for one backward.
        self.pending = len(params)
        self.staging: torch.Tensor | None = None
        self.staging_mpi: CommBuffer | None = None
        self.mpi: CommBuffer | None = None  # what this backward's reduction hands over
        w = world
        self.grad_mpi = w.transport.buffer(self.grad_full, reduction=True) \
            if self.reduces_in_place() and not self.local else None
        self.shard_mpi = w.transport.buffer(self.shard, raw=True) if level == 3 else None
        self._full_mpi: dict[bool, CommBuffer] = {}

    @property
    def nbytes(self) -> int:
        return self.layout.padded * 4

    def bind_grads(self) -> None:
        """fp32 levels 0-1: autograd accumulates into views of the gradient buffer; else
        each gradient is autograd's own tensor until the hook takes it."""
        bind = self.grad_full is not None and self.dtype == torch.float32
        for p, off in zip(self.params, self.layout.offsets):
            p.grad = self.grad_full[off:off + p.numel()].view(p.shape) if bind else None

    def publish_master(self) -> None:
        """bf16: round the updated fp32 master shard into the compute parameters (level
        3: this rank's parameter shard; else its slice of the whole parameters)."""
        if self.level == 3:
            self.shard.copy_(self.master)
        else:
            lo, hi = self.layout.rank_range(self.rank)
            self.full[lo:hi].copy_(self.master)

    def reduces_in_place(self) -> bool:
        """Levels 0-1 reduce the fp32 gradient buffer itself; 2-3 stage it in fp32."""
        return self.grad_full is not None

    def full_mpi(self, reduction: bool = False) -> CommBuffer:
        """The transport's view of ``full`` (``raw``: level 3 frees and re-allocates it),
        for gathers or (``reduction``) fp32 ZeRO-3's reductions."""
        if reduction not in self._full_mpi:
            self._full_mpi[reduction] = self.world.transport.buffer(
                self.full, raw=True, reduction=reduction)
        return self._full_mpi[reduction]
