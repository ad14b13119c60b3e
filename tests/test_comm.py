"""The comm layer in one process: buffers on a real GPU, deadlines, the world.
(The device layer and buffers on the fake device: test_device.py.)"""


import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.buffers import MPIBuffer
from hpctrain.comm.gpu_aware import detect_gpu_aware
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import Threads, World, choose_threads, threads_per_rank
from hpctrain.errors import CommTimeout
from tests.helpers import cpu_world, hpctrain_cmd, run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_watchdog_raises_instead_of_hanging():
    buf = np.zeros(1)
    req = MPI.COMM_SELF.Irecv(buf, source=0, tag=99)  # nobody will ever send this
    with pytest.raises(CommTimeout, match=r"test receive did not complete within 0.3 s"):
        wait_all([req], timeout=0.3, what="test receive")
    req.Cancel()
    req.Wait()


def test_world_on_one_process():
    w = cpu_world(MPI.COMM_SELF)
    assert (w.rank, w.size, w.local_rank, w.local_size, w.node, w.n_nodes) == (0, 1, 0, 1, 0, 1)
    assert w.device == "cpu" and "1 rank(s) on 1 node(s)" in w.describe()


def test_threads_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads_per_rank(4) == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_rank(1) >= 1 and threads_per_rank(10_000) == 1


def test_threads_follow_the_cpus_a_rank_is_bound_to():
    """Issue 29 item 8: OMP_NUM_THREADS=8 on a rank bound to 2 CPUs time-slices them;
    the rank uses the 2 it has and says why."""
    node = dict(node_cpus=64)
    got = choose_threads(4, env={"OMP_NUM_THREADS": "8"}, bound=2, **node)
    assert got == Threads(2, "bound to 2 CPU(s), fewer than OMP_NUM_THREADS=8")
    assert choose_threads(4, env={"OMP_NUM_THREADS": "2"}, bound=16, **node).count == 2
    got = choose_threads(4, env={}, bound=7, **node)
    assert got == Threads(7, "the 7 CPU(s) this rank is bound to")
    got = choose_threads(4, env={"OMP_NUM_THREADS": "x"}, bound=64, **node)
    assert got == Threads(16, "64 CPU(s) shared by 4 rank(s) of the node")


@pytest.mark.slow  # a training under taskset (make test-slow)
def test_the_start_up_line_says_how_many_threads_and_why(dataset_path, tmp_path):
    """A rank bound to 1 CPU (taskset) with OMP_NUM_THREADS=2 trains with 1 thread."""
    p = run(["taskset", "-c", "0", *hpctrain_cmd(
        "train", "default", f"--data.path={dataset_path}", f"--train.out_dir={tmp_path}",
        "--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32",
        "--model.block_size=16", "--train.batch_size=4", "--train.max_iters=1",
        "--train.sample_tokens=0", "--train.eval_interval=0", "--train.final_eval=false",
        "--train.progress=false")], env={"OMP_NUM_THREADS": "2"}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "1 thread(s) per rank (bound to 1 CPU(s), fewer than OMP_NUM_THREADS=2)" \
        in p.stdout, p.stdout


@cuda
@pytest.mark.parametrize("aware", ["no", "yes"])
def test_cuda_tensor_round_trip(aware):
    w = World.create(MPI.COMM_SELF, device="cuda", gpu_aware=aware)
    if aware == "yes" and not detect_gpu_aware("auto", w.accel.vendor):
        pytest.skip("this MPI is not GPU-aware: device pointers would crash it")
    t = torch.arange(8, dtype=torch.float32, device=w.device)
    buf = MPIBuffer(t, w.accel, w.gpu_aware)
    assert buf.staged is (aware == "no")
    MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, buf.to_mpi(), op=MPI.SUM)
    buf.complete()
    w.accel.synchronize()
    assert torch.equal(t.cpu(), torch.arange(8, dtype=torch.float32))
    assert w.accel.stats.event_records >= 1
