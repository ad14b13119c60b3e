"""The accelerator branches on the fake device, over real MPI ranks: data parallelism,
ZeRO (fp32 and bf16) and the pipeline run on ``--train.device=fake`` (CPU memory posing
as GPU memory: DLPack labelled CUDA, host staging, events, backward on its own thread)
and must give the single-process losses, gradients and parameters, with

- no more blocking event waits per step than buckets + gathers + messages + a constant;
- no whole-device synchronization inside a backward pass;
- host staging bytes exactly when MPI is "not GPU-aware", device handoffs when it is;
- no device buffer handed to MPI before its event was waited; no ``.numpy()`` of device
  memory (the fake device raises, as a GPU does);
- under ``--comm.transport=xccl`` (gloo), none handed to the device library unwaited.

What the fake device cannot prove (real device memory, a GPU-aware library, streams
running concurrently): docs/design/devices.md.
"""

import pytest
from mpi4py import MPI

from hpctrain.comm import device_collectives
from hpctrain.comm.phase_clock import DEVICE_EVENTS, PARTS_OF_BACKWARD
from hpctrain.comm.world import World
from hpctrain.comm.xccl_transport import XcclTransport
from hpctrain.train.trainer import Trainer
from tests.helpers import (fit_against_reference, fit_bf16_against_reference, tiny_config,
                           two_ranks_suffice)

pytestmark = [pytest.mark.mpi(min_size=2),
              two_ranks_suffice("each rank's handoffs and waits are checked on their own, "
                                "and the 4-rank leg runs every other MPI test on the fake "
                                "device (HPCTRAIN_AUTO_DEVICE=fake)")]
COMM = MPI.COMM_WORLD
WAIT_SLACK = 2  # blocking waits per step beyond one per bucket, gather and message


def _config(data, out, **overrides):
    # The same configurations as test_dp_mpi / test_zero_mpi / test_pipeline_mpi, so the
    # single-process references are shared (HPCTRAIN_REF_CACHE).
    return tiny_config(data, out, **{"parallel.bucket_mb": 0.02,
                                     "parallel.first_bucket_mb": 0.005, **overrides})


def _fit_on_fake(cfg, aware: str, check=None, collectives: str = "mpi") -> tuple:
    """Train ``cfg`` on the fake device and compare with the reference (``check``,
    default ``fit_against_reference``); returns the trainer and the device counters of
    the training steps (set-up and checks left out)."""
    world = World.create(COMM, device="fake", gpu_aware=aware, collectives=collectives)
    trainer = Trainer(cfg, world, verbose=False)
    stats, counts = world.accel.stats, {}
    fit, before = trainer.fit, stats.snapshot()

    def fit_and_count(close=True):
        result = fit(close=close)
        counts.update({k: v - before[k] for k, v in stats.snapshot().items()})
        counts["phases"] = result.phases
        return result

    trainer.fit = fit_and_count
    if check is not None:
        check(trainer, cfg)
    else:  # replicas of a pipeline stage hold the same values, stages different ones
        fit_against_reference(trainer, cfg, trainer.grid.dp_world.comm
                              if trainer.grid.pp > 1 else COMM)
    world.close()
    return trainer, counts


def _check_counts(trainer, counts: dict, aware: str) -> None:
    steps = trainer.cfg.train.max_iters
    buckets = len(trainer.engine.buckets) if trainer.grid.dp > 1 else 0
    gathers = trainer.engine.stats.gathers / steps
    messages = 2 * getattr(trainer.runner.stats, "messages", 0) / steps  # sends + receives
    waits = counts["event_waits"] / steps
    assert waits <= buckets + gathers + messages + WAIT_SLACK, (
        f"{waits:.1f} blocking event waits per step for {buckets} buckets, {gathers:.1f} "
        f"gathers and {messages:.1f} messages")
    assert counts["device_syncs"] == 0 and counts["syncs_in_backward"] == 0
    _check_phases(trainer, counts["phases"])
    assert counts["unready_handoffs"] == 0 and counts["numpy_on_device"] == 0
    if aware == "no":
        assert counts["staged_bytes"] > 0 and counts["direct_handoffs"] == 0
    elif trainer.world.gpu_aware.reductions:
        assert counts["staged_bytes"] == 0 and counts["direct_handoffs"] > 0
    else:  # Open MPI: its reductions cannot take device memory (staged); sends can
        assert trainer.grid.dp == 1 or counts["staged_bytes"] > 0
        assert trainer.grid.pp == 1 or counts["direct_handoffs"] > 0
    if trainer.grid.dp > 1 and trainer.grid.pp == 1:
        # Reductions start from the gradient hooks, on the backward's own thread (with a
        # pipeline they may all wait for finish(): one chunk's backward per hook pass).
        assert counts["handoffs_off_main_thread"] > 0
        stats = trainer.engine.stats
        assert stats.launched_in_backward >= stats.reductions // 2  # most overlap backward


def _check_phases(trainer, phases: list[dict]) -> None:
    """The phase clock's device events (docs/design/gpu-timing.md): each step's phases
    add up to it, none below zero; the hooks, the wait and a stage's bubble bracketed."""
    assert trainer.world.accel.clock.name == DEVICE_EVENTS
    for step in phases:
        beside = sum(v for k, v in step.items() if k not in (*PARTS_OF_BACKWARD, "step"))
        assert beside == pytest.approx(step["step"]) and min(step.values()) >= 0, step
    total = {k: sum(p[k] for p in phases) for k in phases[0]}
    assert min(total["data"], total["forward"], total["backward"], total["optimizer"]) > 0
    if trainer.grid.dp > 1:
        assert total["wait"] > 0
    if trainer.grid.pp > 1:
        assert total["bubble"] > 0


@pytest.mark.parametrize("aware", ["yes", "no"])
def test_dp_on_the_fake_device(mpi_dataset, shared_tmp, aware):
    cfg = _config(mpi_dataset, shared_tmp, **{"parallel.micro_batches": 2,
                                              "comm.transport": "mpi"})
    trainer, counts = _fit_on_fake(cfg, aware)
    assert trainer.engine.transport.name != "shm"  # device gradients never go through /dev/shm
    _check_counts(trainer, counts, aware)


@pytest.mark.parametrize("stage,aware", [(1, "no"), (2, "yes"), (3, "no"), (3, "yes")])
def test_zero_fp32_on_the_fake_device(mpi_dataset, shared_tmp, stage, aware):
    cfg = _config(mpi_dataset, shared_tmp, **{"parallel.zero": stage,
                                              "parallel.micro_batches": 2})
    trainer, counts = _fit_on_fake(cfg, aware)
    _check_counts(trainer, counts, aware)


@pytest.mark.parametrize("stage,aware", [(0, "yes"), (1, "no"), (3, "no")])
def test_zero_bf16_on_the_fake_device(mpi_dataset, shared_tmp, stage, aware):
    cfg = _config(mpi_dataset, shared_tmp, **{"parallel.zero": stage, "train.dtype": "bf16",
                                              "parallel.micro_batches": 2})
    trainer, counts = _fit_on_fake(cfg, aware, check=fit_bf16_against_reference)
    _check_counts(trainer, counts, aware)


@pytest.mark.parametrize("schedule,virtual,aware", [("1f1b", 1, "no"),
                                                    ("interleaved", 2, "yes")])
def test_pipeline_on_the_fake_device(mpi_dataset, shared_tmp, schedule, virtual, aware):
    """pp=2 (with dp=2 at 4 ranks): activations, gradients and the tied embedding travel
    as device memory or through staging; a send whose tensor the device has not written
    yet is queued, not waited for (the host goes on to the next action)."""
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    cfg = _config(mpi_dataset, shared_tmp, **{
        "model.n_layer": 8, "parallel.pp": 2, "parallel.micro_batches": 4,
        "parallel.schedule": schedule, "parallel.virtual_stages": virtual,
        "train.max_iters": 6})
    trainer, counts = _fit_on_fake(cfg, aware)
    stats = trainer.runner.stats
    assert stats.messages > 0 and 0 < stats.sends_deferred <= stats.messages
    _check_counts(trainer, counts, aware)


@pytest.mark.parametrize("stage", [0, 1])
def test_the_device_library_waits_for_the_fake_devices_events(mpi_dataset, shared_tmp,
                                                                stage):
    """``--comm.transport=xccl`` on the fake device (gloo reads its memory from the host):
    each bucket and shard goes to the library only after the event of its last device
    work was waited for (a host backend reads at once; the fake device's events pass only
    when waited for or seen), and the run gives the single-process result."""
    cfg = _config(mpi_dataset, shared_tmp, **{"parallel.zero": stage,
                                              "parallel.micro_batches": 2})
    try:
        trainer, counts = _fit_on_fake(cfg, "yes", collectives="xccl")
    finally:  # gloo's threads keep polling their sockets: leave the group
        COMM.Barrier()
        device_collectives.stop()
    assert isinstance(trainer.engine.world.transport, XcclTransport)
    assert trainer.engine.world.transport.name == "gloo"
    assert counts["direct_handoffs"] > 0  # the library was handed device memory
    assert counts["unready_handoffs"] == 0, counts
    assert counts["staged_bytes"] == 0 and counts["numpy_on_device"] == 0
    assert counts["device_syncs"] == 0


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("aware", ["yes", "no"])
def test_expert_parallelism_on_the_fake_device(mpi_dataset, shared_tmp, aware, zero):
    """ep = 2: the tokens' all-to-all and the experts' reductions over their own ranks
    hand device memory over only once written, and never synchronize the device."""
    from tests.test_expert_parallel_mpi import MOE

    cfg = _config(mpi_dataset, shared_tmp, **{**MOE, "parallel.ep": 2, "parallel.zero": zero})
    trainer, counts = _fit_on_fake(cfg, aware, check=lambda t, c: fit_against_reference(
        t, c, t.grid.expert_world.comm))
    assert counts["device_syncs"] == 0 and counts["syncs_in_backward"] == 0
    _check_phases(trainer, counts["phases"])
    assert counts["unready_handoffs"] == 0 and counts["numpy_on_device"] == 0
    if aware == "no":
        assert counts["staged_bytes"] > 0 and counts["direct_handoffs"] == 0
    else:  # the all-to-all hands device memory over; Open MPI's reductions stage it
        assert counts["direct_handoffs"] > 0
        assert (counts["staged_bytes"] == 0) == trainer.world.gpu_aware.reductions
