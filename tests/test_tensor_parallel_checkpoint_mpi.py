"""Checkpoints of tensor-parallel runs over real MPI ranks: a save at tp=2 (with data
parallelism and ZeRO, or a pipeline) holds whole tensors that every other layout reads,
``ckpt reshard`` / ``merge`` / ``export`` move them bit for bit, and a checkpoint of one
rank resumes at tp=2 on every rank.

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.checkpoint import ckpt_commands
from hpctrain.checkpoint.sharded import read_full_state, read_manifest
from hpctrain.checkpoint.weights import load_weights
from hpctrain.train.trainer import Trainer
from tests.helpers import (assert_same_state, cpu_world, read_safetensors_by_hand,
                           resumes_exactly_and_reshards, tiny_config)

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
SMALL = {"model.n_head": 4, "model.vocab_multiple": 8, "parallel.bucket_mb": 0.02,
         "parallel.first_bucket_mb": 0.005, "train.ckpt_interval": 5,
         "train.save_checkpoint": True}
STEP5 = "checkpoints/step_000005"


def _fit(data, out, comm=COMM, **overrides):
    trainer = Trainer(tiny_config(data, out, **{**SMALL, **overrides}), cpu_world(comm),
                      verbose=False)
    result = trainer.fit(close=False)
    whole = {}
    for stage in trainer.grid.pp_comm.allgather(trainer.engine.consolidated_state()):
        whole.update(stage)  # every stage's parameters
    trainer.close()
    return result, whole


def _tensor_parallel_layouts():
    """tp=2 with ZeRO-1 over the rest of the ranks (at 2 ranks also a mixture of experts,
    whose experts are sliced by hidden units); at 4 ranks also tp=2 x pp=2 under
    1F1B (layers cut in order, the head and its copy of the embedding slice on stage 1)
    and under zbv (stage 0 holds layers 0 and 3 and the head beside the embedding;
    ``slow``, the 4-rank leg's time: the 2-rank leg reshards a zbv checkpoint without tp)."""
    layouts = [{"parallel.tp": 2, "parallel.zero": 1}]
    if COMM.size == 2:  # a mixture of experts: each expert's hidden units in slices
        layouts.append({"parallel.tp": 2, "model.moe_experts": 4, "model.moe_shared": 1,
                        "model.moe_shared_gate": True})
    if COMM.size % 4 == 0:
        pipeline = {"parallel.tp": 2, "parallel.pp": 2, "model.n_layer": 4,
                    "parallel.micro_batches": 2, "parallel.sequence_parallel": True}
        zbv = {**pipeline, "parallel.schedule": "zbv", "parallel.micro_batches": 4}
        layouts += [pipeline, pytest.param(zbv, marks=pytest.mark.slow, id=_layout_id(zbv))]
    return layouts


def _layout_id(layout: dict) -> str:
    return "-".join(f"{k.split('.')[1]}{v}" for k, v in layout.items()
                    if k.startswith("parallel.") or k == "model.moe_experts")


@pytest.mark.parametrize("layout", _tensor_parallel_layouts(), ids=_layout_id)
def test_a_tensor_parallel_checkpoint_moves_to_one_rank_and_back(mpi_dataset, shared_tmp,
                                                                  layout):
    """Saved at tp=2: the checkpoint's whole tensors are the live model's (joined over the
    group), a resume in the same layout is bitwise identical, one rank resumes it (and its
    ``ckpt reshard --world 1`` copy) to fp32 round-off, and the resharded copy resumes at
    tp=2 bitwise like the original: the reshard moved every byte unchanged."""
    big, live = _fit(mpi_dataset, f"{shared_tmp}/big", **layout)
    manifest = read_manifest(f"{shared_tmp}/big/checkpoints/step_000010")
    assert manifest.data["tensor_parallel"] == 2
    summary = json.loads(Path(f"{shared_tmp}/big/summary.json").read_text())
    assert summary["grid"]["tp"] == 2
    assert_same_state(read_full_state(manifest), live)

    resharded = resumes_exactly_and_reshards(_fit, mpi_dataset, shared_tmp, layout,
                                             big.losses)
    COMM.Barrier()
    model = {k: v for k, v in layout.items() if k.startswith("model.")}
    one = COMM.Split(color=int(COMM.rank == 0), key=COMM.rank)
    if COMM.rank == 0:
        for source in (f"{shared_tmp}/big/{STEP5}", resharded):
            shrunk, _ = _fit(mpi_dataset, f"{shared_tmp}/one-{source[-4:]}", one,
                             **model, **{"train.resume": source})
            np.testing.assert_allclose(shrunk.losses, big.losses[5:], atol=1e-5, rtol=0)
    one.Free()
    back, _ = _fit(mpi_dataset, f"{shared_tmp}/back", **layout,
                   **{"train.resume": resharded})
    assert back.losses == big.losses[5:]


def test_a_one_rank_checkpoint_resumes_at_tp2_on_every_rank(mpi_dataset, shared_tmp):
    """Grown from one rank to tp=2 x dp: the losses continue the one-rank run's."""
    one = COMM.Split(color=int(COMM.rank == 0), key=COMM.rank)
    small = None
    if COMM.rank == 0:
        small, _ = _fit(mpi_dataset, f"{shared_tmp}/small", one)
    one.Free()
    small = COMM.bcast(small.losses if small else None)
    grown, _ = _fit(mpi_dataset, f"{shared_tmp}/grown", **{
        "parallel.tp": 2, "parallel.zero": 2, "parallel.sequence_parallel": True,
        "train.resume": f"{shared_tmp}/small/{STEP5}"})
    np.testing.assert_allclose(grown.losses, small[5:], atol=1e-5, rtol=0)


def test_merge_export_and_init_from_read_a_tensor_parallel_checkpoint(mpi_dataset,
                                                                      shared_tmp):
    """``ckpt merge`` and ``ckpt export`` of a tp=2 checkpoint hold the whole parameters,
    and ``--train.init_from`` of it starts a tp=2 run and a one-rank run at the same
    first loss."""
    _, live = _fit(mpi_dataset, f"{shared_tmp}/run", **{"parallel.tp": 2,
                                                        "train.max_iters": 5})
    step5 = f"{shared_tmp}/run/{STEP5}"
    if COMM.rank == 0:
        merged = ckpt_commands.merge(step5, f"{shared_tmp}/merged.h5")
        exported = ckpt_commands.export(step5, "safetensors", f"{shared_tmp}/model.safetensors")
        params, _, _ = load_weights(merged)
        assert_same_state({n: {"param": p} for n, p in params.items()}, live, ("param",))
        tensors = read_safetensors_by_hand(exported)
        assert torch.equal(tensors["h.0.attn.c_attn.weight"],
                           live["h.0.attn.c_attn.weight"]["param"])
    COMM.Barrier()
    tp2, _ = _fit(mpi_dataset, f"{shared_tmp}/tp2", **{"parallel.tp": 2,
                                                       "train.init_from": step5})
    one = COMM.Split(color=int(COMM.rank == 0), key=COMM.rank)
    if COMM.rank == 0:
        single, _ = _fit(mpi_dataset, f"{shared_tmp}/single", one,
                         **{"train.init_from": step5})
        np.testing.assert_allclose(tp2.losses, single.losses, atol=1e-5, rtol=0)
    one.Free()
