"""A signal that reaches one rank only stops every rank at the same point: in the loop
within two steps, in a periodic evaluation within two forward passes, and during the
final evaluation with the final checkpoint on disk."""

import os
import signal

import pytest
from mpi4py import MPI

import hpctrain.train.stop as stop_module
from hpctrain.checkpoint.sharded import read_manifest
from hpctrain.comm.features import persistent_collectives
from hpctrain.train.stop import SignalFlag, StopAgreement
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


def _trainer(mpi_dataset, out, **over):
    cfg = tiny_config(mpi_dataset, out, **{"train.save_checkpoint": True, **over})
    return Trainer(cfg, cpu_world(COMM), verbose=False)


def _signal_last_rank_before(obj, method, when=lambda *a: True):
    original = getattr(obj, method)

    def wrapped(*args, **kwargs):
        if COMM.rank == COMM.size - 1 and when(*args):
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    setattr(obj, method, wrapped)


def test_one_signalled_rank_stops_all_ranks_after_the_same_step(mpi_dataset, shared_tmp):
    trainer = _trainer(mpi_dataset, shared_tmp, **{"train.max_iters": 30})
    _signal_last_rank_before(trainer, "train_step", when=lambda step: step == 4)
    result = trainer.fit()
    assert COMM.allgather(result.stopped_at) == [result.stopped_at] * COMM.size
    assert 5 <= result.stopped_at <= 6
    assert read_manifest(shared_tmp).step == result.stopped_at


def test_one_signalled_rank_during_the_final_evaluation_leaves_the_final_checkpoint(
        mpi_dataset, shared_tmp):
    trainer = _trainer(mpi_dataset, shared_tmp, **{"train.final_eval": True})
    _signal_last_rank_before(trainer.evaluator, "_loss")
    result = trainer.fit()
    assert COMM.allgather(result.final_val_loss) == [None] * COMM.size
    assert result.stopped_at == 10 and read_manifest(shared_tmp).step == 10


def test_one_signalled_rank_during_a_long_evaluation_stops_every_rank_at_the_same_pass(
        mpi_dataset, shared_tmp):
    """Issue 39, item 12: the ranks agree before each forward pass of a periodic
    evaluation, so every rank abandons it after the same pass, far short of its 1,000
    batches, and saves the step it evaluated."""
    trainer = _trainer(mpi_dataset, shared_tmp, **{
        "train.max_iters": 30, "train.eval_interval": 5, "train.eval_iters": 1000})
    passes, loss = [], trainer.evaluator._loss

    def counted(x, y):
        passes.append(1)
        if len(passes) == 3 and COMM.rank == COMM.size - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss(x, y)

    trainer.evaluator._loss = counted
    result = trainer.fit()
    assert COMM.allgather((len(passes), result.stopped_at)) == [(4, 5)] * COMM.size
    assert read_manifest(shared_tmp).step == 5


@pytest.mark.parametrize("persistent", [True, False])
def test_the_agreement_reads_a_flag_one_agreement_later_on_every_rank(monkeypatch,
                                                                      persistent):
    """Persistent (``Allreduce_init``) or started anew (``Iallreduce``), the same answers."""
    if not persistent:
        monkeypatch.setattr(stop_module, "persistent_collectives", lambda comm, timeout: False)
    elif not persistent_collectives(COMM):  # collective: every rank skips
        pytest.skip("the MPI library has no persistent collectives")
    flag = SignalFlag()
    agreement = StopAgreement(COMM, flag, timeout=60)
    assert (agreement._persistent is not None) == persistent
    answers = []
    for step in range(1, 6):
        if step == 3 and COMM.rank == COMM.size - 1:
            flag.trip("a test")
        answers.append(agreement.agreed(step))
    agreement.close()
    assert answers == [False, False, False, True, True]
    assert COMM.allgather(answers) == [answers] * COMM.size


@pytest.mark.parametrize("cause", ["the time limit", "SIGUSR1"])
def test_every_rank_names_the_cause_the_stopping_rank_had(cause):
    """The last rank alone has a reason (its deadline passed first, or a signal came):
    after the agreement every rank stops for that reason, so rank 0's log and the job's
    exit message name it (a rank without one of its own once said 'a signal')."""
    flag = SignalFlag()
    agreement = StopAgreement(COMM, flag, timeout=60)
    if COMM.rank == COMM.size - 1:
        if cause == "SIGUSR1":
            flag.received = signal.SIGUSR1
        else:
            flag.trip("the time limit", "its own deadline")
    answers = [agreement.agreed(step) for step in (1, 2)]
    agreement.close()
    assert answers == [False, True]
    assert COMM.allgather(flag.cause) == [cause] * COMM.size
    later = SignalFlag()  # the blocking agreement outside the loop, likewise
    if COMM.rank == COMM.size - 1:
        later.trip("the time limit", "its own deadline")
    blocking = StopAgreement(COMM, later, timeout=60)
    assert blocking.now("a test") is True
    blocking.close()
    assert later.cause == "the time limit"
