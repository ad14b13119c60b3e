"""The comm layer in one process: buffers, CUDA-awareness detection, deadlines."""

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.buffers import MPIBuffer, detect_cuda_aware
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import World, threads_per_rank
from hpctrain.errors import CommTimeout

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_numpy_and_torch_cpu_buffers_alias_the_memory():
    a = np.arange(4, dtype=np.float32)
    assert MPIBuffer(a).obj is a
    t = torch.arange(4, dtype=torch.float32)
    buf = MPIBuffer(t)
    buf.to_mpi()[0] = 42.0
    assert t[0].item() == 42.0 and not buf.staged


def test_bf16_travels_as_its_bit_pattern():
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    dst = torch.zeros(2, dtype=torch.bfloat16)
    MPI.COMM_SELF.Sendrecv(MPIBuffer(t).to_mpi(), 0, 0, MPIBuffer(dst).obj, 0, 0)
    assert torch.equal(dst, t)


def test_non_contiguous_and_unknown_types_are_refused():
    with pytest.raises(ValueError, match="contiguous"):
        MPIBuffer(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="cannot communicate a list"):
        MPIBuffer([1, 2])


@pytest.mark.parametrize("env, expected", [
    ({"HPCTRAIN_CUDA_AWARE": "1"}, True),
    ({"HPCTRAIN_CUDA_AWARE": "0", "MPICH_GPU_SUPPORT_ENABLED": "1"}, False),
    ({"MPICH_GPU_SUPPORT_ENABLED": "1"}, True),
    ({"MV2_USE_CUDA": "1"}, True),
    ({"OMPI_MCA_opal_cuda_support": "true"}, True),
])
def test_cuda_awareness_from_the_environment(env, expected):
    found = detect_cuda_aware("auto", env=env)
    assert found.enabled is expected and found.reason


def test_cuda_awareness_defaults_to_staging_and_can_be_forced():
    # The PyPI MPICH here is not built with CUDA: the library query must say no.
    assert not detect_cuda_aware("auto", env={})
    assert detect_cuda_aware("yes", env={})
    with pytest.raises(ValueError):
        detect_cuda_aware("maybe", env={})


def test_watchdog_raises_instead_of_hanging():
    buf = np.zeros(1)
    req = MPI.COMM_SELF.Irecv(buf, source=0, tag=99)  # nobody will ever send this
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match=r"test receive did not complete within 0.3 s"):
        wait_all([req], timeout=0.3, what="test receive")
    assert time.monotonic() - t0 < 2
    req.Cancel()
    req.Wait()


def test_world_on_one_process():
    w = World.create(MPI.COMM_SELF, use_cuda=False)
    assert (w.rank, w.size, w.local_rank, w.local_size, w.node, w.n_nodes) == (0, 1, 0, 1, 0, 1)
    assert w.device == "cpu" and "1 rank(s) on 1 node(s)" in w.describe()


def test_threads_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(4) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_rank(1) >= 1 and threads_per_rank(10_000) == 1


@cuda
@pytest.mark.parametrize("aware", [False, True])
def test_cuda_tensor_round_trip(aware):
    if aware and not detect_cuda_aware():
        pytest.skip("this MPI is not CUDA-aware: device pointers would crash it")
    t = torch.arange(8, dtype=torch.float32, device="cuda")
    buf = MPIBuffer(t, cuda_aware=aware)
    assert buf.staged is not aware
    MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, buf.to_mpi(), op=MPI.SUM)
    buf.from_mpi()
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.arange(8, dtype=torch.float32))
