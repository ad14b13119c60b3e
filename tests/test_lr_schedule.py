"""The learning-rate schedules as functions of the step, and a run resumed in the middle of
a warmup-stable-decay's decay continuing it exactly."""

import json

import pytest
from mpi4py import MPI

from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.train.schedule import learning_rate
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config


def _optim(*args):
    return load_config("default", ["--optim.lr=1e-3", "--optim.min_lr=1e-4",
                                   "--optim.warmup_iters=10", *args]).optim


def test_wsd_holds_the_peak_then_decays_linearly_over_its_fraction_to_min_lr():
    cfg = _optim("--optim.schedule=wsd", "--optim.decay_fraction=0.2")
    lrs = [learning_rate(s, cfg, 110) for s in range(121)]
    assert lrs[9] < lrs[10] == 1e-3  # the warm-up reaches the peak...
    assert set(lrs[10:91]) == {1e-3}  # ...which holds until the last 20 of the 100 steps
    decay = lrs[90:111]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    steps = [b - a for a, b in zip(decay, decay[1:])]
    assert max(steps) == pytest.approx(min(steps))  # linear
    assert lrs[110:] == [1e-4] * 11


def test_wsd_decay_ends_at_lr_decay_iters_when_it_is_set():
    cfg = _optim("--optim.schedule=wsd", "--optim.decay_fraction=0.5",
                 "--optim.lr_decay_iters=50")
    assert learning_rate(29, cfg, 1000) == 1e-3
    assert 1e-4 < learning_rate(31, cfg, 1000) < 1e-3
    assert learning_rate(50, cfg, 1000) == learning_rate(900, cfg, 1000) == 1e-4


def test_cosine_is_halfway_at_the_middle_of_its_decay():
    cfg = _optim()
    assert learning_rate(60, cfg, 110) == pytest.approx((1e-3 + 1e-4) / 2)
    assert learning_rate(110, cfg, 110) == 1e-4


@pytest.mark.parametrize("value", ["0", "1.5", "nan"])
def test_a_decay_fraction_outside_0_1_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="optim.decay_fraction"):
        _optim("--optim.schedule=wsd", f"--optim.decay_fraction={value}")


def test_a_run_resumed_mid_decay_continues_the_wsd_schedule_exactly(dataset_path, tmp_path):
    """The decay covers steps 11-19; the resumed run starts from step 14, inside it."""
    over = {"optim.schedule": "wsd", "optim.decay_fraction": 0.5, "train.log_interval": 1,
            "train.save_checkpoint": True, "train.ckpt_interval": 7, "train.max_iters": 20}

    def fit(out, **more):
        return Trainer(tiny_config(dataset_path, out, **over, **more),
                       cpu_world(MPI.COMM_SELF), verbose=False).fit()

    full = fit(tmp_path / "a")
    resumed = fit(tmp_path / "b",
                  **{"train.resume": str(tmp_path / "a" / "checkpoints" / "step_000014")})
    assert resumed.losses == full.losses[14:]  # the same bits

    def rates(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r}

    full_lr, resumed_lr = rates(tmp_path / "a"), rates(tmp_path / "b")
    assert resumed_lr == {s: lr for s, lr in full_lr.items() if s > 14}
    assert len(set(resumed_lr.values())) == len(resumed_lr)  # every resumed step decays
