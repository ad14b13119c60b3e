"""``--train.fp8=true`` over real MPI ranks on the fake device (torchao's emulated FP8):
ZeRO-3 at dp = 2, the bf16 data-parallel engine (ZeRO level 0) at dp = 2 and a 2-stage
pipeline each give the losses and fp32 master weights of the single-process FP8 run, to 1e-5.

The single-process run splits its batch into as many micro-batches as the parallel run
has data-parallel ranks (the sampler gives rank r the rows of micro-batch r): FP8's
dynamic scales are each matrix multiply's own absolute maximum, so a run with whole-batch
scales rounds differently from ranks that each scale their half (measured: master
weights 1e-2 apart after 6 steps at dp = 2). The head is untied: one process sums a tied
embedding's two gradients in bf16, a pipeline in fp32 across its stages, and FP8's
coarse rounding turns that bf16 difference into 6e-3 on the weights (1e-4 without FP8);
with the same rounding everywhere the layouts agree exactly (measured: losses within
2.4e-7, master weights equal).
"""

import numpy as np
import pytest
import torch
from mpi4py import MPI

pytest.importorskip("torchao")

from hpctrain.comm.world import World  # noqa: E402
from hpctrain.train.trainer import Trainer  # noqa: E402
from tests.helpers import same_on_all_ranks, tiny_config, two_ranks_suffice  # noqa: E402

pytestmark = [pytest.mark.mpi(min_size=2),
              two_ranks_suffice("FP8 converts the same layers whatever the ranks; the "
                                "engines' and the pipeline's own 4-rank cases are in their "
                                "files")]
COMM = MPI.COMM_WORLD

LAYOUTS = {
    "zero3": ({"parallel.zero": 3}, 2),
    "dp_bf16": ({"parallel.zero": 0}, 2),
    "pp2": ({"parallel.pp": 2, "parallel.micro_batches": 2}, 2),
}
"""layout -> (its overrides, the single-process run's micro-batches)."""


def _config(data, out, **overrides):
    return tiny_config(data, out, **{"train.dtype": "bf16", "train.fp8": True,
                                     "train.max_iters": 6, "model.tie_embeddings": False,
                                     "parallel.bucket_mb": 0.02,
                                     "parallel.first_bucket_mb": 0.005, **overrides})


def _single_process(cfg) -> tuple[list, dict]:
    """Rank 0 trains ``cfg`` alone; every rank gets its losses and master weights."""
    out = None
    if COMM.rank == 0:
        trainer = Trainer(cfg, World.create(MPI.COMM_SELF, device="fake"), verbose=False)
        result = trainer.fit(close=False)
        master = {n: s["param"].clone() for n, s in trainer.engine.consolidated_state().items()}
        trainer.close()
        out = (result.losses, master)
    return COMM.bcast(out, root=0)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_layouts_match_the_single_process_fp8_run(mpi_dataset, shared_tmp, layout):
    overrides, micro = LAYOUTS[layout]
    losses, master = _single_process(_config(mpi_dataset, f"{shared_tmp}/one", **{
        "parallel.micro_batches": micro}))
    cfg = _config(mpi_dataset, f"{shared_tmp}/run", **overrides)
    trainer = Trainer(cfg, World.create(COMM, device="fake"), verbose=False)
    assert len(trainer.par.fp8.converted) == 4 * cfg.model.n_layer  # the whole model's
    result = trainer.fit(close=False)
    np.testing.assert_allclose(result.losses, losses, atol=1e-5, rtol=0)
    mine = trainer.engine.consolidated_state()
    assert set(mine) == {n for n, _ in trainer.model.named_parameters()}
    for name, state in mine.items():
        assert same_on_all_ranks(trainer.grid.dp_world.comm, state["param"]), name
        torch.testing.assert_close(state["param"], master[name], atol=1e-5,
                                   rtol=0, msg=name)
    trainer.close()
