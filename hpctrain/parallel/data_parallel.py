"""Data parallelism with a hand-written, bucketed gradient allreduce (after PyTorch DDP,
Li et al., VLDB 2020).

Parameters are grouped into buckets in reverse registration order; each bucket owns one
flat fp32 buffer that the parameters' ``.grad`` views, and a post-accumulate-grad hook
starts its reduction, in bucket order, once its last gradient lands. The sum goes
through a ``Transport`` (MPI persistent or nonblocking collectives, or one node's shared
memory, where ``finish()`` sums after backward instead). Averaging is folded into the
loss (``grad_scale``). The engine owns its fused AdamW (``step``), as ``Zero`` does.
Buckets, transports, GPUs and the measurements: docs/design/data-parallelism.md.
"""

from __future__ import annotations

import functools
import math

import torch

from hpctrain.comm.buffers import persistent_allreduce_works
from hpctrain.comm.features import persistent_collectives
from hpctrain.comm.mpi import MPI
from hpctrain.comm.shm_allreduce import use_shared_memory
from hpctrain.comm.shm_transport import ShmTransport
from hpctrain.comm.transport import PersistentMPITransport, Request, Transport
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import World
from hpctrain.config import OptimConfig
from hpctrain.parallel.bucketing import BucketScheduler, plan_buckets, split_by_kind
from hpctrain.parallel.engine import (STATE_KEYS, EngineState, finish_norm, local_norm_squares,
                                     nothing_to_gather, norm_duplicates)
from hpctrain.parallel.experts.apply import is_expert
from hpctrain.parallel.memory import MemoryReport, tensor_bytes
from hpctrain.parallel.optim import build_optimizer, clip_grads_, param_groups
from hpctrain.parallel.tensor.split_state import TensorSplit
from hpctrain.profiling import profile_range
from hpctrain.sizes import MiB



class Bucket:
    """A flat fp32 gradient buffer; each parameter's ``.grad`` is a view into it."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], transport: Transport,
                 flat: torch.Tensor | None = None):
        """``transport``: what sums this bucket (for experts: over the ranks holding the
        same experts, not every replica)."""
        for p in params:
            if p.dtype != torch.float32:
                raise TypeError(f"bucketed allreduce expects fp32 parameters, got {p.dtype}")
        self.index = index
        self.params = params
        self.transport = transport
        numel = sum(p.numel() for p in params)
        # ``flat`` given: the bucket lives in the node's shared-memory window.
        self.use_flat(torch.zeros(numel, dtype=torch.float32, device=params[0].device)
                      if flat is None else flat)
        self.pending = len(params)

    def use_flat(self, flat: torch.Tensor) -> None:
        """Make ``flat`` the bucket's buffer: the per-parameter views point into it."""
        self.flat = flat
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.buffer = self.transport.buffer(flat, reduction=True)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def bind_grads(self) -> None:
        for p, view in zip(self.params, self.views):
            p.grad = view


def persistent_collectives_supported(comm: MPI.Comm) -> bool:
    """True when the library implements MPI-4 persistent collectives. Collective."""
    return persistent_collectives(comm)


def gradient_transport(world: World, numels: list[int], first: torch.Tensor, *,
                       allreduce: str = "auto", persistent: bool | None = None,
                       node_comm: MPI.Comm | None = None) -> Transport:
    """The transport that sums the gradient buckets (of ``numels`` fp32 elements; ``first``:
    a parameter, for its device): the node's shared memory (``allreduce``, see
    ``use_shared_memory``), MPI persistent collectives where the library has them
    (``persistent``: None decides so), else the world's (MPI ``Iallreduce`` or the device
    library). Collective over ``world.comm``; every rank gets the same kind."""
    comm = world.comm
    if use_shared_memory(allreduce, comm, world.accel.kind, numels,
                         ranks_on_node=world.local_size, collectives=world.collectives):
        # node_comm: the ranks sharing a window (default: the node; tests pass less)
        return ShmTransport(comm, world.accel, world.gpu_aware, numels, node_comm=node_comm)
    if persistent is None:
        persistent = (world.size > 1 and world.transport.name == "mpi"
                      and persistent_collectives_supported(comm))
        aware = world.gpu_aware
        if persistent and world.accel.holds(first) and aware.direct and aware.reductions:
            # The host probe says nothing of device memory handed over directly: try one.
            persistent = persistent_allreduce_works(comm, world.accel, aware, world.timeout)
    if persistent:
        return PersistentMPITransport(comm, world.accel, world.gpu_aware)
    return world.transport


class DataParallel(BucketScheduler):
    """Keeps ``model``'s gradients identical on every rank of ``world``."""

    state_kind = "replicated"
    """The ``EngineState`` kind it saves and a checkpoint for it holds (engine.py)."""

    def __init__(self, model: torch.nn.Module, world: World, optim_cfg: OptimConfig, *,
                 bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 persistent: bool | None = None, allreduce: str = "auto",
                 node_comm: MPI.Comm | None = None, norm_comms: tuple = (),
                 tp_comm: MPI.Comm | None = None, broadcast: bool = True,
                 experts: World | None = None, ep_comm: MPI.Comm | None = None):
        """``optim_cfg``: the optimizer ``step()`` runs. ``broadcast``: start every rank
        from rank 0's parameters. ``norm_comms``, ``tp_comm``, ``experts``, ``ep_comm``:
        see engine.py."""
        self.model = model
        self.tensor_split = TensorSplit(model, tp_comm, world.timeout, ep_comm=ep_comm)
        self.experts = experts
        self.norm_comms = ([self.tensor_split.norm_comm] if self.tensor_split.active
                           else []) + list(norm_comms)
        if experts is not None:
            allreduce = "mpi"  # two groups: the shared-memory window holds one
        self.world = world
        self.comm = world.comm
        self.size = world.size
        params = [p for p in model.parameters() if p.requires_grad]  # tied weights once
        order = params[::-1]
        groups = plan_buckets([p.numel() for p in order], 4, int(bucket_mb * MiB),
                              int(first_bucket_mb * MiB))
        kinds = [experts is not None and is_expert(p) for p in order]
        groups = split_by_kind(groups, kinds)
        numels = [sum(order[j].numel() for j in g) for g in groups]
        self.transport = gradient_transport(world, numels, order[0], allreduce=allreduce,
                                            persistent=persistent, node_comm=node_comm)
        """What sums the buckets (``gradient_transport``); the world's once closed."""
        shm = self.transport if isinstance(self.transport, ShmTransport) else None
        self.buckets = [Bucket(i, [order[j] for j in g],
                               experts.transport if kinds[g[0]] else self.transport,
                               shm.flat(i) if shm else None)
                        for i, g in enumerate(groups)]
        super().__init__(self.buckets, timeout=world.timeout, clock=world.accel.clock)
        # Hooks start reductions during backward where something else then advances
        # them: MPI (GPU gradients, the MPI path) or, across nodes, the inter-node part
        # of the shared-memory sums. Not with one rank, nor for sums in one node's memory.
        self.hooked = self.size > 1 and (shm is None or shm.across_nodes)
        if self.hooked:
            for b in self.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(
                        functools.partial(self._on_grad_ready, b))
        self.persistent = isinstance(self.transport, PersistentMPITransport)
        if shm is not None:
            self.summed_by = "shared memory" + (" + MPI between nodes" if shm.across_nodes
                                                else "")
        elif self.transport.name != "mpi":
            self.summed_by = f"{self.transport.name} allreduce"
        else:
            self.summed_by = "MPI persistent Allreduce" if self.persistent else "MPI Iallreduce"
        """How gradients are summed, in words (kept after ``close()``, for reports)."""
        self.zero_grad()
        if broadcast:
            self.broadcast_parameters()
        self.optimizer = build_optimizer(param_groups(model, optim_cfg.weight_decay), optim_cfg)

    @property
    def grad_scale(self) -> float:
        """Multiply the loss by this: the allreduce sums, the scale turns it into a mean."""
        return 1.0 / self.size

    def grad_tensors(self) -> list[torch.Tensor]:
        """The flat gradient buffers (for clipping and norms: few large tensors)."""
        return [b.flat for b in self.buckets]

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.flat.zero_()
            b.bind_grads()  # in case anything set .grad to None

    def broadcast_parameters(self, root: int = 0) -> None:
        """Give every rank ``root``'s parameters, one bucket-sized broadcast at a time
        (experts: from ``root`` of the ranks holding the same ones)."""
        if self.size == 1:
            return
        with torch.no_grad():
            for b in self.buckets:
                torch.cat([p.detach().reshape(-1) for p in b.params], out=b.flat)
                req = b.transport.broadcast(b.buffer, root)
                wait_all([req], timeout=self.world.timeout,
                         what=f"broadcast of parameters (bucket {b.index})")
                b.buffer.complete()
                for p, view in zip(b.params, b.views):
                    p.copy_(view)
                b.flat.zero_()

    def prepare_for_backward(self, last_micro: bool) -> None:
        super().prepare_for_backward(sync=last_micro)

    def _on_grad_ready(self, bucket: Bucket, _param: torch.nn.Parameter) -> None:
        self.grad_ready(bucket)

    def bucket_ready(self, b: Bucket) -> None:
        b.buffer.prepare()  # an event behind the last gradient (or the staging copy)

    def can_launch(self, b: Bucket) -> bool:
        return b.buffer.ready()

    def launch(self, b: Bucket) -> Request:
        self.stats.reductions += 1
        self.stats.bytes_reduced += b.nbytes
        with profile_range(f"allreduce bucket {b.index}"):
            return b.transport.allreduce(b.buffer)

    def complete(self, b: Bucket) -> None:
        b.buffer.complete()

    def finish(self) -> None:
        """Complete every bucket's reduction; gradients are then the global mean."""
        if self.size > 1:
            with profile_range("allreduce wait"):
                super().finish()

    # --------------------------------------------------------------- optimizer
    def step(self, lr: float, clip: float) -> float:
        """Global norm of the (reduced) gradients; clip and update unless it is NaN/inf.
        Returns the norm before clipping."""
        whole, copies = norm_duplicates(
            [(v, p) for b in self.buckets for p, v in zip(b.params, b.views)],
            self.tensor_split)
        squares = local_norm_squares(self.grad_tensors(), whole, copies)
        value = finish_norm(squares, self.norm_comms, self.world.timeout)
        if not math.isfinite(value):
            return value
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if clip > 0:
            clip_grads_(self.grad_tensors(), clip, value)
        with profile_range("optimizer"):
            self.optimizer.step()
        return value

    def _named_state(self):
        for name, p in self.model.named_parameters():
            yield name, p, self.optimizer.state.get(p, {})

    def state_shards(self) -> EngineState:
        """Every parameter whole, with its moments (zeros before the first step)."""
        params, step = {}, 0.0
        for name, p, state in self._named_state():
            params[name] = {"param": p.detach()}
            for k in STATE_KEYS[1:]:
                v = state.get(k)
                params[name][k] = v.detach() if v is not None else torch.zeros_like(p)
            if "step" in state:
                step = float(state["step"])
        return EngineState(self.state_kind, step, params=params)

    def consolidated_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Parameters and the optimizer's state by name (whole on every rank; split
        parameters gathered over the tensor-parallel group)."""
        return self.tensor_split.whole(
            {name: {"param": p.detach(), **state} for name, p, state in self._named_state()})

    def load_full_state(self, full: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        full = self.tensor_split.local(full)
        with torch.no_grad():
            for name, p, _ in self._named_state():
                p.copy_(full[name]["param"])
                state = self.optimizer.state[p]
                state["step"] = torch.tensor(step, dtype=torch.float32, device=p.device)
                for k in STATE_KEYS[1:]:
                    state[k] = full[name][k].to(p.device, p.dtype).clone()

    def load_shards(self, shards: list[dict], step: float) -> None:
        """A replicated checkpoint holds whole tensors, which ``load_full_state`` takes;
        only an engine that saves ``"zero"`` shards is handed its own back."""
        raise TypeError("DataParallel saves a replicated checkpoint; load it with "
                        "load_full_state")

    def gathered(self):
        return nothing_to_gather(self.model)

    def describe(self) -> str:
        summed = f" summed by {self.summed_by}" if self.size > 1 else ""
        experts = (f", experts reduced over {self.experts.size} rank(s)"
                   if self.experts is not None else "")
        return f"{len(self.buckets)} gradient bucket(s){summed}{experts}, ZeRO level 0"

    def memory(self) -> MemoryReport:
        """Bytes this rank holds: replicated parameters, gradient buckets, AdamW state."""
        params = sum(tensor_bytes(p) for p in self.model.parameters())
        grads = sum(tensor_bytes(b.flat) for b in self.buckets)
        optim = sum(tensor_bytes(v) for state in self.optimizer.state.values()
                    for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
        staging = sum(b.buffer.staging_nbytes for b in self.buckets)
        return MemoryReport(params=params, grads=grads, optimizer=optim, comm_buffers=staging)

    def close(self) -> None:
        """Release the gradient transport's resources (persistent requests, the shared
        window). Collective when the gradients live in shared memory; idempotent."""
        if self.transport is self.world.transport:
            return  # the world's: its owner closes it
        if isinstance(self.transport, ShmTransport):
            for b in self.buckets:  # keep the gradients readable once the window is gone
                b.transport = self.world.transport
                b.use_flat(b.flat.clone())
                b.bind_grads()
        self.transport.close()
        self.transport = self.world.transport
