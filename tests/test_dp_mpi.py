"""Data parallelism over real MPI ranks, against the single-process result.

Run with ``mpiexec -n 2 python -m pytest --only-mpi`` (and ``-n 4``). Every rank also
runs the plain single-process PyTorch loop on the whole global batch and compares.
"""

import dataclasses

import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.features import persistent_collectives
from hpctrain.config import OptimConfig
from hpctrain.data.mpiio import library_name
from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.parallel.data_parallel import DataParallel
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, fit_against_reference, same_on_all_ranks, SGD, tiny_config

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


def _same_on_all_ranks(tensor: torch.Tensor) -> bool:
    return same_on_all_ranks(COMM, tensor)


@pytest.mark.parametrize("micro_batches,allreduce", [(1, "shm"), (2, "shm"), (1, "mpi"),
                                                     (2, "mpi")])
def test_dp_matches_single_process(mpi_dataset, shared_tmp, micro_batches, allreduce):
    """First-step reduced gradients and norm, every loss, final parameters."""
    cfg = tiny_config(mpi_dataset, shared_tmp, **{"parallel.micro_batches": micro_batches,
                                                  "comm.transport": allreduce,
                                                  "parallel.bucket_mb": 0.02,
                                                  "parallel.first_bucket_mb": 0.005})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    assert len(trainer.engine.buckets) >= 3  # several buckets in flight, not one
    assert (trainer.engine.transport.name == "shm") == (allreduce == "shm")
    fit_against_reference(trainer, cfg, COMM)


@pytest.mark.parametrize("allreduce", ["shm", "mpi"])
def test_dp_with_plain_sgd_matches_single_process(mpi_dataset, shared_tmp, allreduce):
    """No momentum, no clipping: the update is lr x gradient, so a wrong gradient scale
    changes the loss from the second step on (AdamW would hide it)."""
    cfg = tiny_config(mpi_dataset, shared_tmp, **SGD, **{"parallel.micro_batches": 2,
                                                         "comm.transport": allreduce})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    fit_against_reference(trainer, cfg, COMM)


class CountingComm:
    """Delegates to a real communicator and counts the gradient reductions launched."""

    def __init__(self, comm):
        self._comm, self.iallreduce_calls = comm, 0

    def Iallreduce(self, *args, **kwargs):
        self.iallreduce_calls += 1
        return self._comm.Iallreduce(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _flats_equal_across_ranks(dp) -> bool:
    return all(_same_on_all_ranks(b.flat) for b in dp.buckets)


@pytest.mark.parametrize("allreduce,persistent", [("mpi", False), ("mpi", True),
                                                  ("shm", None)])
def test_no_communication_on_non_final_micro_batches(allreduce, persistent):
    if persistent and not persistent_collectives(COMM):  # collective: every rank skips
        pytest.skip(f"{library_name()} has no MPI_Allreduce_init")
    spy = CountingComm(COMM)
    world = dataclasses.replace(cpu_world(COMM), comm=spy)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=32))
    dp = DataParallel(model, world, OptimConfig(), bucket_mb=0.01, first_bucket_mb=0.004,
                      persistent=persistent, allreduce=allreduce)
    x = torch.randint(0, 32, (3, 2, 8), generator=torch.Generator().manual_seed(COMM.rank))
    for micro in range(2):
        dp.prepare_for_backward(last_micro=False)
        model(x[micro], x[micro]).backward()
        dp.finish()
        assert dp.stats.reductions == 0 and spy.iallreduce_calls == 0
        assert not _flats_equal_across_ranks(dp)  # each rank kept its own gradients
    dp.prepare_for_backward(last_micro=True)
    model(x[2], x[2]).backward()
    launched_during_backward = dp.stats.reductions
    dp.finish()
    assert dp.stats.reductions == len(dp.buckets) > 2
    assert spy.iallreduce_calls == (len(dp.buckets) if persistent is False else 0)
    if allreduce == "mpi":
        assert launched_during_backward >= 1  # reductions overlap the backward pass
    else:  # sums in one node's memory: all after backward, by finish()
        assert launched_during_backward == 0
    assert _flats_equal_across_ranks(dp)
    summed = [b.flat.clone() for b in dp.buckets]
    dp.close()  # the gradients stay readable (and in place) once the window is freed
    assert all(torch.equal(b.flat, s) for b, s in zip(dp.buckets, summed))
    assert all(p.grad.data_ptr() == v.data_ptr() for b in dp.buckets
               for p, v in zip(b.params, b.views))


def test_bucket_layout_and_broadcast_agree_across_ranks():
    torch.manual_seed(COMM.rank)  # deliberately different initial weights per rank
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=32))
    dp = DataParallel(model, cpu_world(COMM), OptimConfig(), bucket_mb=0.01,
                      first_bucket_mb=0.004)
    layout = [(len(b.params), b.flat.numel()) for b in dp.buckets]
    assert COMM.allgather(layout) == [layout] * COMM.size
    dp.broadcast_parameters()
    for p in model.parameters():
        assert _same_on_all_ranks(p)
    assert all(b.flat.abs().sum() == 0 for b in dp.buckets)  # staging left clean


def test_world_describes_this_single_node_job():
    w = cpu_world(COMM)
    assert (w.rank, w.size) == (COMM.rank, COMM.size)
    assert w.n_nodes == 1 and w.node == 0 and w.local_size == COMM.size
    assert sorted(COMM.allgather(w.local_rank)) == list(range(COMM.size))


@pytest.mark.parametrize("allreduce", ["mpi", "shm"])
def test_summary_times_the_reductions_of_each_step(mpi_dataset, shared_tmp, allreduce):
    """With several ranks the gradient hooks spend time on reductions (MPI) and
    ``finish`` waits for them, or sums them all (one node's shared memory): both appear
    in ``timing.phases_ms``, averaged over the ranks."""
    import json
    from pathlib import Path

    cfg = tiny_config(mpi_dataset, shared_tmp, **{"train.max_iters": 20,
                                                  "comm.transport": allreduce,
                                                  "parallel.bucket_mb": 0.02,
                                                  "parallel.first_bucket_mb": 0.005})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    trainer.fit()
    from hpctrain.train.timing import peak_rss_bytes

    # summary.json's memory_by_rank: each rank's own numbers, in rank order.
    mine = COMM.gather({**trainer.memory().to_dict(), "peak_rss_bytes": peak_rss_bytes()})
    if COMM.rank == 0:
        summary = json.loads((Path(shared_tmp) / "summary.json").read_text())
        by_rank = summary["memory_by_rank"]
        assert len(by_rank) == COMM.size
        for recorded, now in zip(by_rank, mine):
            assert {k: v for k, v in recorded.items() if k != "peak_rss_bytes"} == \
                {k: v for k, v in now.items() if k != "peak_rss_bytes"}
            assert 0 < recorded["peak_rss_bytes"] <= now["peak_rss_bytes"]
        assert summary["peak_rss_bytes_max_rank"] == max(r["peak_rss_bytes"] for r in by_rank)
        phases = summary["timing"]["phases_ms"]
        if allreduce == "mpi":
            assert phases["hooks"] > 0 and phases["wait"] >= 0
            assert phases["hooks"] < phases["backward"]
        else:
            assert phases["hooks"] == 0 and phases["wait"] > 0
    COMM.Barrier()


@pytest.mark.parametrize("batches", [0, 2])
def test_final_evaluation_covers_its_windows_across_replicas(mpi_dataset, shared_tmp,
                                                             batches):
    """Each data-parallel replica evaluates its share of the validation windows (every
    one, or 2 x 64 spread over the split); the final loss is the token-weighted mean over
    all of them, the single-process number (a replica that reported only its own share
    differs at 2 ranks already; so does a spread that depended on the rank count)."""
    from pathlib import Path

    common = {"train.final_eval": True, "train.max_iters": 4,
              "train.final_eval_batches": batches}
    out = Path(shared_tmp) / str(batches)
    result = Trainer(tiny_config(mpi_dataset, out / "dp", **common), cpu_world(COMM),
                     verbose=False).fit()
    assert same_on_all_ranks(COMM, torch.tensor([result.final_val_loss]))
    if COMM.rank == 0:
        ref = Trainer(tiny_config(mpi_dataset, out / "ref", **common),
                      cpu_world(MPI.COMM_SELF), verbose=False).fit()
        assert abs(result.final_val_loss - ref.final_val_loss) <= 1e-5
    COMM.Barrier()
