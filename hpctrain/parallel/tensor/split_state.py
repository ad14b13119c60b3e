"""Whole tensors in, whole tensors out: how a gradient engine over a tensor-parallel model
keeps its checkpoint interface (``engine.py``) the same as without one.

An engine's ``consolidated_state`` (``final.h5``, export, sampling) and
``load_full_state`` (a resume in another layout, ``--train.init_from``) speak of whole
per-parameter tensors by name. Under tensor parallelism the engine holds this rank's
slices; ``TensorSplit`` gathers them into whole tensors over the group, and cuts this
rank's slices out of whole ones, for exactly the parameters that carry a ``ShardSpec``
(``layers.is_split``). A sharded checkpoint keeps the slices as they are, under
``qualified`` names (``name@tp<rank>``) that ``layout.join_slices`` puts together again.
Expert parallelism's slices of the experts (``experts/apply.py``: dimension 0 over the
expert group, ``ep_comm``) go the same way, named ``name@ep<rank>``.
"""

from __future__ import annotations

import numpy as np
import torch

from hpctrain.comm.mpi import MPI
from hpctrain.comm.watchdog import wait_all
from hpctrain.parallel.tensor.layers import SPLIT
from hpctrain.model.plan import ShardSpec
from hpctrain.parallel.tensor.layout import EXPERT_QUALIFIER, qualified_name, shard, unshard

SLICED_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""The per-parameter tensors that have the parameter's shape (``step`` is a number)."""


class TensorSplit:
    """The split parameters of ``model`` and the group (``comm``) that holds their
    slices; with no split parameter (tp = 1) every method passes its input through."""

    def __init__(self, model: torch.nn.Module, comm: MPI.Comm | None = None,
                 timeout: float = 600.0, *, ep_comm: MPI.Comm | None = None,
                 attr: str = SPLIT, qualifier: str | None = None):
        """``ep_comm``: the expert group, whose slices of the experts a second
        ``TensorSplit`` (``experts``) handles; ``attr``/``qualifier``: which parameters
        (their ``ShardSpec`` attribute) and how a checkpoint names a slice."""
        comm = MPI.COMM_SELF if comm is None else comm  # tp = 1
        self.specs: dict[str, ShardSpec] = {
            n: getattr(p, attr) for n, p in model.named_parameters()
            if getattr(p, attr, None) is not None}
        self.comm, self.timeout, self.qualifier = comm, timeout, qualifier
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.experts: TensorSplit | None = None
        """The expert-parallel slices (ep > 1), else None."""
        if ep_comm is not None and ep_comm.Get_size() > 1:
            from hpctrain.parallel.experts.apply import EXPERT_SLICE

            self.experts = TensorSplit(model, ep_comm, timeout, attr=EXPERT_SLICE,
                                       qualifier=EXPERT_QUALIFIER)

    @property
    def active(self) -> bool:
        """Whether anything is sliced (over the tensor-parallel or the expert group)."""
        return self.size > 1 or self.experts is not None

    @property
    def norm_comm(self) -> MPI.Comm:
        """The group a replicated engine sums the norm's squares over: the
        tensor-parallel group, or the expert group (tp = 1 with experts)."""
        return self.experts.comm if self.experts is not None else self.comm

    @property
    def copies(self) -> int:
        """How many ranks of ``norm_comm`` hold each parameter that is not sliced."""
        return self.experts.size if self.experts is not None else self.size

    def sliced(self, name: str) -> bool:
        return name in self.specs or (self.experts is not None and name in self.experts.specs)

    def qualified(self, name: str) -> str:
        """``name`` as a sharded checkpoint records it: a slice names its rank."""
        if self.experts is not None and name in self.experts.specs:
            return self.experts.qualified(name)
        if name not in self.specs:
            return name
        return (qualified_name(name, self.rank) if self.qualifier is None
                else f"{name}{self.qualifier}{self.rank}")

    def whole_shape(self, name: str, shape) -> tuple[int, ...]:
        """The shape of the whole tensor of which this rank holds ``shape``."""
        if self.experts is not None and name in self.experts.specs:
            return self.experts.whole_shape(name, shape)
        spec = self.specs.get(name)
        if spec is None:
            return tuple(shape)
        return tuple(n * self.size if d == spec.dim else n for d, n in enumerate(shape))

    def local(self, full: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's slices of whole per-parameter tensors (other entries as they are)."""
        if self.experts is not None:
            full = self.experts.local(full)
        if self.size == 1:
            return full
        out = dict(full)
        for name, spec in self.specs.items():
            if name in full:
                out[name] = {k: shard(v, spec, self.rank, self.size) if k in SLICED_KEYS else v
                             for k, v in full[name].items()}
        return out

    def whole(self, state: dict[str, dict[str, torch.Tensor]]
              ) -> dict[str, dict[str, torch.Tensor]]:
        """Whole tensors from every rank's slices, on every rank of the group (collective;
        one all-gather of every slice, in fp32 on the host)."""
        if self.experts is not None:
            state = self.experts.whole(state)
        if self.size == 1:
            return state
        pieces = [(name, k) for name in self.specs for k in SLICED_KEYS if k in state[name]]
        mine = [state[n][k].detach().float().cpu().reshape(-1) for n, k in pieces]
        flat = torch.cat(mine).numpy() if mine else np.zeros(0, np.float32)
        every = np.empty((self.size, flat.size), np.float32)
        wait_all([self.comm.Iallgather(flat, every)], timeout=self.timeout,
                 what="gathering tensor-parallel slices")
        out = dict(state)
        for name in self.specs:
            out[name] = dict(state[name])
        offset = 0
        for (name, k), t in zip(pieces, mine):
            n = t.numel()
            shape = state[name][k].shape
            slices = [torch.from_numpy(every[r, offset:offset + n]).reshape(shape)
                      for r in range(self.size)]
            out[name][k] = unshard(slices, self.specs[name])
            offset += n
        return out
