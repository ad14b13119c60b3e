"""Model FLOP utilization against the rate the run's matrix multiplies actually use
(``train/metrics.py``): bf16 on the matrix units, TF32 for fp32 with ``--train.tf32`` on
a GPU, fp32 otherwise; ranks sharing a device share its peak; the summary says which."""

import json

import pytest
from mpi4py import MPI

from hpctrain.comm.world import count_devices
from hpctrain.train.metrics import Peak, device_peak
from hpctrain.train.result import step_record
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config


@pytest.mark.parametrize("device,dtype,tf32,accelerator,basis,tflops", [
    ("NVIDIA A100-SXM4-40GB", "bf16", True, True, "bf16", 312.0),
    ("NVIDIA A100-SXM4-40GB", "fp32", True, True, "tf32", 156.0),  # not the vector rate
    ("NVIDIA A100-SXM4-40GB", "fp32", False, True, "fp32", 19.5),
    ("NVIDIA H100 80GB HBM3", "fp32", True, True, "tf32", 494.7),
    ("AMD Instinct MI250X", "fp32", True, True, "fp32_matrix", 47.9),  # no TF32 on CDNA2
    ("AMD Instinct MI250X", "bf16", True, True, "bf16", 191.5),
    ("NVIDIA A100-SXM4-40GB", "fp32", True, False, "fp32", 19.5),  # TF32 only on a GPU
])
def test_the_peak_is_the_rate_the_matrix_multiplies_use(device, dtype, tf32, accelerator,
                                                        basis, tflops):
    peak = device_peak(device, dtype, tf32=tf32, accelerator=accelerator)
    assert (peak.basis, peak.tflops) == (basis, tflops)
    assert peak.why


def test_an_unknown_device_has_no_peak_unless_one_is_given():
    unknown = device_peak("cpu", "fp32", tf32=True, accelerator=False)
    assert unknown.tflops is None and "--train.peak_tflops" in unknown.why
    assert unknown.mfu(1e12) is None
    given = device_peak("cpu", "fp32", tf32=True, accelerator=False, override=2.0)
    assert (given.tflops, given.basis) == (2.0, "override")


def test_ranks_sharing_a_device_share_its_peak():
    # Two ranks on one GPU: together they reach the device's rate, not twice it.
    assert count_devices([(0, "gpu-a"), (0, "gpu-a")], 1) == (2, 1)
    assert count_devices([(0, "gpu-a"), (0, "gpu-b"), (1, "gpu-a")], 2) == (1, 3)
    assert count_devices([(0, "rank 0"), (0, "rank 1")], 0) == (1, 2)  # host ranks
    shared = Peak(100.0, "bf16", "", devices=1)
    apart = Peak(100.0, "bf16", "", devices=2)
    args = (1, 2.0, 1e-3, 1000.0, 0.1, 1.0, 0.0, 0.0, 0.0)
    one = step_record(*args, flops_per_token=1e8, peak=shared, skipped=0)
    two = step_record(*args, flops_per_token=1e8, peak=apart, skipped=0)
    assert one["mfu"] == pytest.approx(1e11 / 1e14) and one["tflops_per_device"] == 0.1
    assert two["mfu"] == pytest.approx(one["mfu"] / 2)


def test_a_world_on_the_host_counts_one_device_per_rank():
    world = cpu_world(MPI.COMM_SELF)
    assert (world.ranks_per_device, world.devices) == (1, 1)


def test_the_summary_records_which_peak_and_why(dataset_path, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path, **{"train.peak_tflops": 0.5,
                                                 "train.max_iters": 2})
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peak"] == {"tflops": 0.5, "basis": "override",
                               "why": "--train.peak_tflops", "devices": 1}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().split("\n")
               if line]
    assert all(r["mfu"] > 0 for r in records if "mfu" in r)


@pytest.mark.parametrize("dtype,basis,tflops", [("bf16", "bf16", 312.0),
                                                ("fp32", "tf32", 156.0)])
def test_the_trainer_asks_the_peak_of_its_compute_dtype(dataset_path, tmp_path, monkeypatch,
                                                        dtype, basis, tflops):
    """A known GPU (the fake device named as an A100): the run's own dtype picks the rate,
    so bf16 runs are measured against the bf16 peak, not the fp32 (or TF32) one."""
    from hpctrain.comm.fake_device import FakeAccelerator
    from hpctrain.comm.world import World

    monkeypatch.setattr(FakeAccelerator, "name", property(lambda self: "NVIDIA A100-SXM4-40GB"))
    cfg = tiny_config(dataset_path, tmp_path, **{"train.dtype": dtype, "train.max_iters": 1,
                                                 "train.device": "fake"})
    trainer = Trainer(cfg, World.create(MPI.COMM_SELF, device="fake", gpu_aware="no"),
                      verbose=False)
    assert (trainer.peak.basis, trainer.peak.tflops) == (basis, tflops)

