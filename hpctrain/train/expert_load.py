"""Where a mixture of experts sent its tokens: per-expert copy counts, dropped copies and
the router losses of every MoE layer, summed over the ranks and written into each
``metrics.jsonl`` record (``moe_*`` keys), which the run report plots.

Each rank counts the routing of its own tokens (before any all-to-all), so the sum over
the ranks of a step is the global batch's: data-parallel ranks route different tokens,
pipeline stages hold different layers, and tensor-parallel ranks route the same tokens
(divided out). The reduction is one small allreduce per logged step.
"""

from __future__ import annotations

import numpy as np

from hpctrain.comm.small_collectives import allreduce_array
from hpctrain.model.common.moe import moe_layers
from hpctrain.model.moe_shape import is_moe_block


class ExpertLoad:
    def __init__(self, model, cfg, world, *, copies: int):
        """``model``: what this rank holds; ``cfg``: the whole model's ``GPTConfig``;
        ``world``: every rank of the run; ``copies``: ranks that route the same tokens
        (the tensor-parallel group)."""
        self.layers = moe_layers(model)
        self.indexes = [i for i in range(cfg.n_layer) if is_moe_block(cfg, i)]
        self.n_experts = cfg.moe_experts
        self.comm, self.copies, self.timeout = world.comm, copies, world.timeout

    def take(self, steps: int) -> dict:
        """The counts since the last call, per step of the ``steps`` it covers, and
        restart counting (collective; {} for a dense model)."""
        if not self.indexes:
            return {}
        E = self.n_experts
        rows = np.zeros((len(self.indexes), E + 4))  # load..., dropped, aux, z, passes
        for layer in self.layers:
            v = layer.stats.values()
            rows[self.indexes.index(layer.index)] = [*v["load"], v["dropped"], v["aux"],
                                                     v["z"], v["passes"]]
            layer.stats.reset()
        total = allreduce_array(self.comm, rows.ravel(), timeout=self.timeout,
                                what="expert load").reshape(rows.shape)
        total[:, :E + 1] /= self.copies * max(steps, 1)
        passes = np.maximum(total[:, E + 3], 1)
        load = total[:, :E]
        mean = load.mean(1, keepdims=True)
        return {"moe_load": [[round(float(c), 2) for c in row] for row in load],
                "moe_imbalance": float((load.max(1) / np.maximum(mean[:, 0], 1e-12)).max()),
                "moe_dropped": float(total[:, E].sum()),
                "moe_aux_loss": float((total[:, E + 1] / passes).mean()),
                "moe_z_loss": float((total[:, E + 2] / passes).mean())}
