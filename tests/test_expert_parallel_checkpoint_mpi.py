"""Checkpoints of expert-parallel runs over real MPI ranks: a save at ep = the world
(2 or 4) records each rank's experts as ``name@ep<r>`` slices that read back as the
whole stacked tensors, resumes in the same layout bit for bit, moves to one rank through
``ckpt reshard`` byte for byte, and resumes from there at ep = 2 (at 4 ranks: ep = 2 x
dp = 2) continuing the losses; ``ckpt merge`` holds whole experts.

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint import ckpt_commands
from hpctrain.checkpoint.sharded import read_full_state, read_manifest
from hpctrain.checkpoint.weights import load_weights
from hpctrain.train.trainer import Trainer
from tests.helpers import (assert_same_state, cpu_world, resumes_exactly_and_reshards,
                           tiny_config)
from tests.test_expert_parallel_mpi import MOE

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
SAVES = {"train.ckpt_interval": 5, "train.save_checkpoint": True}
STEP5 = "checkpoints/step_000005"


def _fit(data, out, comm=COMM, **overrides):
    trainer = Trainer(tiny_config(data, out, **{**MOE, **SAVES, **overrides}),
                      cpu_world(comm), verbose=False)
    result = trainer.fit(close=False)
    whole = trainer.engine.consolidated_state()
    trainer.close()
    return result, whole


@pytest.mark.parametrize("zero", [0, 1])
def test_an_expert_parallel_checkpoint_moves_to_one_rank_and_to_another_ep(
        mpi_dataset, shared_tmp, zero):
    ep = COMM.size
    layout = {"parallel.ep": ep, "parallel.zero": zero}
    big, live = _fit(mpi_dataset, f"{shared_tmp}/big", **layout)
    manifest = read_manifest(f"{shared_tmp}/big/checkpoints/step_000010")
    assert manifest.data["expert_parallel"] == ep
    recorded = manifest.data["index"]
    names = (recorded["params"] if zero == 0
             else [n for b in recorded["buckets"] for n in b["names"]])
    assert any(n.endswith(f"w_in@ep{ep - 1}") for n in names)
    full = read_full_state(manifest)
    assert full["h.0.mlp.experts.w_in"]["param"].shape[0] == 4  # every expert
    # inspect counts a sliced tensor once: as many tensors as the whole state has
    assert f"  {len(full)} tensors, " in ckpt_commands.inspect(manifest.path)
    assert_same_state(full, live)

    resharded = resumes_exactly_and_reshards(_fit, mpi_dataset, shared_tmp, layout,
                                             big.losses)
    if COMM.rank == 0:
        merged, _, _ = load_weights(ckpt_commands.merge(f"{shared_tmp}/big/{STEP5}",
                                                        f"{shared_tmp}/merged.h5"))
        assert merged["h.1.mlp.experts.w_out"].shape[0] == 4
    COMM.Barrier()
    one = COMM.Split(color=int(COMM.rank == 0), key=COMM.rank)
    if COMM.rank == 0:
        shrunk, _ = _fit(mpi_dataset, f"{shared_tmp}/one", one,
                         **{"train.resume": resharded})
        np.testing.assert_allclose(shrunk.losses, big.losses[5:], atol=1e-5, rtol=0)
    one.Free()
    other, _ = _fit(mpi_dataset, f"{shared_tmp}/other", **{
        "parallel.ep": 2, "parallel.zero": 1 - zero, "train.resume": resharded})
    np.testing.assert_allclose(other.losses, big.losses[5:], atol=1e-5, rtol=0)


def test_a_bf16_expert_parallel_checkpoint_resumes_bit_for_bit(mpi_dataset, shared_tmp):
    """bf16 (fp32 master weights; ep = 2, x dp = 2 at 4 ranks): the checkpoint holds the
    whole master weights and a resume in the same layout repeats the losses exactly."""
    layout = {"parallel.ep": 2, "train.dtype": "bf16", "train.max_iters": 6,
              "train.ckpt_interval": 3}
    first, live = _fit(mpi_dataset, f"{shared_tmp}/first", **layout)
    assert_same_state(read_full_state(read_manifest(
        f"{shared_tmp}/first/checkpoints/step_000006")), live)
    again, _ = _fit(mpi_dataset, f"{shared_tmp}/again", **layout, **{
        "train.resume": f"{shared_tmp}/first/checkpoints/step_000003"})
    assert again.losses == first.losses[3:]
