"""Whole tensors in, whole tensors out: how a gradient engine over a tensor-parallel model
keeps its checkpoint interface (``engine.py``) the same as without one.

An engine's ``consolidated_state`` (``final.h5``, export, sampling) and
``load_full_state`` (a resume in another layout, ``--train.init_from``) speak of whole
per-parameter tensors by name. Under tensor parallelism the engine holds this rank's
slices; ``TensorSplit`` gathers them into whole tensors over the group, and cuts this
rank's slices out of whole ones, for exactly the parameters that carry a ``ShardSpec``
(``layers.is_split``). A sharded checkpoint keeps the slices as they are, under
``qualified`` names (``name@tp<rank>``) that ``layout.join_slices`` puts together again.
"""

from __future__ import annotations

import numpy as np
import torch

from hpctrain.comm.mpi import MPI
from hpctrain.comm.watchdog import wait_all
from hpctrain.parallel.tensor.layers import SPLIT
from hpctrain.model.plan import ShardSpec
from hpctrain.parallel.tensor.layout import qualified_name, shard, unshard

SLICED_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""The per-parameter tensors that have the parameter's shape (``step`` is a number)."""


class TensorSplit:
    """The split parameters of ``model`` and the group (``comm``) that holds their
    slices; with no split parameter (tp = 1) every method passes its input through."""

    def __init__(self, model: torch.nn.Module, comm: MPI.Comm | None = None,
                 timeout: float = 600.0):
        comm = MPI.COMM_SELF if comm is None else comm  # tp = 1
        self.specs: dict[str, ShardSpec] = {
            n: getattr(p, SPLIT) for n, p in model.named_parameters()
            if getattr(p, SPLIT, None) is not None}
        self.comm, self.timeout = comm, timeout
        self.size, self.rank = comm.Get_size(), comm.Get_rank()

    @property
    def active(self) -> bool:
        return self.size > 1

    def qualified(self, name: str) -> str:
        """``name`` as a sharded checkpoint records it: a slice names its rank."""
        return qualified_name(name, self.rank) if name in self.specs else name

    def whole_shape(self, name: str, shape) -> tuple[int, ...]:
        """The shape of the whole tensor of which this rank holds ``shape``."""
        spec = self.specs.get(name)
        if spec is None:
            return tuple(shape)
        return tuple(n * self.size if d == spec.dim else n for d, n in enumerate(shape))

    def local(self, full: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's slices of whole per-parameter tensors (other entries as they are)."""
        if not self.active:
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
        if not self.active:
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
