"""Put a pipelined model back together on one rank (final checkpoint, sampling).

Every replica holds the same stage parameters, so only replica 0's pipeline takes part:
each of its stages sends its parameters, flattened, to stage 0 (world rank 0), which
cuts them back into tensors by the names and shapes gathered first. Done once at the
end of training, not per step.
"""

from __future__ import annotations

import numpy as np
import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.small_collectives import gather_json
from hpctrain.comm.watchdog import wait_all

TAG = 7


def gather_parameters(params: dict[str, torch.Tensor], grid: ProcessGrid,
                      timeout: float) -> dict[str, torch.Tensor] | None:
    """Every stage's ``params`` (name -> tensor, e.g. the fp32 master weights) on world
    rank 0 (fp32, CPU); None elsewhere. Collective over the ranks of replica 0."""
    if grid.dp_world.rank != 0:  # replica 0's first context-parallel rank gathers
        return None
    comm = grid.pp_comm
    named = [(n, p.detach().float().cpu()) for n, p in params.items()]
    meta = gather_json(comm, [(n, list(t.shape)) for n, t in named], timeout=timeout,
                       what="parameter names of every pipeline stage")
    flat = np.concatenate([t.numpy().ravel() for _, t in named]) if named else np.zeros(0, np.float32)
    if comm.Get_rank() != 0:
        wait_all([comm.Isend(flat, dest=0, tag=TAG)], timeout=timeout,
                 what="sending stage parameters to rank 0")
        return None
    params = {n: t.clone() for n, t in named}
    for src in range(1, comm.Get_size()):
        shapes = meta[src]
        buf = np.empty(sum(int(np.prod(s)) for _, s in shapes), dtype=np.float32)
        wait_all([comm.Irecv(buf, source=src, tag=TAG)], timeout=timeout,
                 what=f"receiving the parameters of pipeline stage {src}")
        offset = 0
        for name, shape in shapes:
            n = int(np.prod(shape))
            params.setdefault(name, torch.from_numpy(buf[offset:offset + n].reshape(shape)))
            offset += n
    return params
