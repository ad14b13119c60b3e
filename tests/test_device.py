"""The device layer in one process: choosing a device, GPU-aware MPI per vendor, the MPI
thread level, buffers to MPI on the fake accelerator (DLPack, staging, events)."""

import threading

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.buffers import MPIBuffer, to_mpi_all
from hpctrain.comm.device import Accelerator
from hpctrain.comm.fake_device import FakeAccelerator
from hpctrain.comm.placement import Visible, choose_kind, device_index
from hpctrain.comm.gpu_aware import (GPUAwareness, LibraryFacts, detect_gpu_aware,
                                     library_family)
from hpctrain.comm.world import World, check_thread_level
from hpctrain.config import ConfigError, load_config
from hpctrain.errors import UserError

NONE = {"cuda": Visible(0), "xpu": Visible(0)}
YES = GPUAwareness(True, "test")
NO = GPUAwareness(False, "test")


@pytest.fixture
def fake():
    accel = FakeAccelerator(0)
    yield accel
    accel.close()


# ------------------------------------------------------------------- choosing a device

def test_auto_takes_the_visible_accelerator_else_the_cpu():
    assert choose_kind("auto", visible=NONE, env={}) == "cpu"
    assert choose_kind("auto", visible={**NONE, "xpu": Visible(12)}, env={}) == "xpu"
    assert choose_kind("auto", visible={"cuda": Visible(4), "xpu": Visible(0)},
                       env={}) == "cuda"
    assert choose_kind("fake", visible=NONE, env={}) == "fake"


def test_hpctrain_auto_device_names_what_auto_takes():
    four = {"cuda": Visible(4), "xpu": Visible(0)}
    assert choose_kind("auto", visible=four, env={"HPCTRAIN_AUTO_DEVICE": "cpu"}) == "cpu"
    assert choose_kind("auto", visible=NONE, env={"HPCTRAIN_AUTO_DEVICE": "fake"}) == "fake"
    assert choose_kind("cuda", visible=four, env={"HPCTRAIN_AUTO_DEVICE": "cpu"}) == "cuda"
    with pytest.raises(UserError, match="HPCTRAIN_AUTO_DEVICE='gpu' is not one of"):
        choose_kind("auto", visible=four, env={"HPCTRAIN_AUTO_DEVICE": "gpu"})


def test_a_system_that_promises_gpus_never_trains_on_cpus_silently():
    with pytest.raises(UserError) as e:
        choose_kind("auto", system="polaris", env={},
                    visible={"cuda": Visible(0, "CUDA_VISIBLE_DEVICES=3"), "xpu": Visible(0)})
    text = str(e.value)
    assert "\n" not in text and "HPCTRAIN_SYSTEM=polaris promises 4 GPU(s)" in text
    assert "CUDA_VISIBLE_DEVICES=3" in text and "--train.device=cpu" in text
    for system in ("aurora", "perlmutter", "frontier"):
        with pytest.raises(UserError, match=f"HPCTRAIN_SYSTEM={system} promises"):
            choose_kind("auto", system=system, visible=NONE, env={})
    assert choose_kind("cpu", system="polaris", visible=NONE) == "cpu"  # on purpose
    assert choose_kind("auto", system="local", visible=NONE, env={}) == "cpu"  # no GPUs promised


def test_asking_for_a_device_that_is_not_there_is_one_line():
    with pytest.raises(UserError) as e:
        choose_kind("xpu", visible={**NONE, "xpu": Visible(0, "ZE_AFFINITY_MASK=0.1")})
    assert "\n" not in str(e.value)
    assert "--train.device=xpu: this process sees no xpu device with ZE_AFFINITY_MASK=0.1" \
        in str(e.value)


@pytest.mark.slow  # a subprocess
def test_train_device_xpu_without_one_exits_2(dataset_path, tmp_path):
    from tests.helpers import hpctrain_cmd, run

    out = run(hpctrain_cmd("train", "default", f"--data.path={dataset_path}",
                           f"--train.out_dir={tmp_path}", "--train.device=xpu"))
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--train.device=xpu: this process sees no xpu" in lines[0]


@pytest.mark.parametrize("local_rank, count, masks, expected", [
    (3, 4, [None] * 4, 3),  # one rank per GPU, nothing masked
    (5, 4, [None] * 8, 1),  # more ranks than GPUs: shared out
    (2, 4, ["CUDA_VISIBLE_DEVICES=0,1,2,3"] * 4, 2),  # one node-wide mask
    (2, 1, [f"CUDA_VISIBLE_DEVICES={3 - r}" for r in range(4)], 0),  # per-rank masks
    (1, 2, ["ZE_AFFINITY_MASK=0.0,0.1", "ZE_AFFINITY_MASK=1.0,1.1"], 0),  # own pair
])
def test_local_rank_to_device_respects_the_launcher_s_masks(local_rank, count, masks,
                                                           expected):
    index, how = device_index(local_rank, count, masks)
    assert index == expected and how


def test_old_option_names_say_the_new_ones():
    with pytest.raises(ConfigError, match="--comm.cuda_aware is now --comm.gpu_aware"):
        load_config("default", ["--comm.cuda_aware=yes"])
    with pytest.raises(ConfigError, match="--comm.device is now --train.device"):
        load_config("default", ["--comm.device=cpu"])
    assert load_config("default", ["--train.device=fake"]).train.device == "fake"


# ------------------------------------------------------------------ GPU-aware MPI

MPICH_NO = {"MPIX_Query_cuda_support": 0, "MPIX_Query_ze_support": 0,
            "MPIX_Query_hip_support": 0, "MPIX_GPU_query_support(0)": 0}


@pytest.mark.parametrize("vendor, facts, env, direct, reason", [
    # MPICH answers per vendor; the environment is not believed over it.
    ("cuda", LibraryFacts("mpich", {**MPICH_NO, "MPIX_Query_cuda_support": 1}), {}, True,
     "MPIX_Query_cuda_support() == 1"),
    ("cuda", LibraryFacts("mpich", MPICH_NO), {"MPICH_GPU_SUPPORT_ENABLED": "1"}, False,
     "MPIX_Query_cuda_support() == 0"),
    ("ze", LibraryFacts("mpich", {**MPICH_NO, "MPIX_Query_ze_support": 1}), {}, True,
     "MPIX_Query_ze_support"),
    # Only the generic query: the right type ids (CUDA 0, ZE 1, HIP 2).
    ("ze", LibraryFacts("mpich", {"MPIX_GPU_query_support(0)": 1,
                                  "MPIX_GPU_query_support(1)": 0}), {}, False,
     "MPIX_GPU_query_support(1)"),
    ("hip", LibraryFacts("mpich", {"MPIX_GPU_query_support(2)": 1}), {}, True,
     "MPIX_GPU_query_support(2)"),
    # Cray MPICH: the GTL library and the switch, both.
    ("cuda", LibraryFacts("cray-mpich", {}, ("libmpi_gtl_cuda",)),
     {"MPICH_GPU_SUPPORT_ENABLED": "1"}, True, "libmpi_gtl_cuda loaded"),
    ("cuda", LibraryFacts("cray-mpich", {}, ()), {"MPICH_GPU_SUPPORT_ENABLED": "1"}, False,
     "libmpi_gtl_cuda is not loaded"),
    ("hip", LibraryFacts("cray-mpich", {}, ("libmpi_gtl_hsa",)), {}, False,
     "MPICH_GPU_SUPPORT_ENABLED is not 1"),
    # Open MPI spells HIP "rocm"; an environment switch alone proves nothing.
    ("hip", LibraryFacts("open-mpi", {"MPIX_Query_rocm_support": 1}), {}, True, "rocm"),
    ("cuda", LibraryFacts("open-mpi", {}), {"OMPI_MCA_opal_cuda_support": "true"}, False,
     "no CUDA support query"),
    ("cuda", LibraryFacts("mvapich", {}), {"MV2_USE_CUDA": "1"}, True, "MV2_USE_CUDA=1"),
    ("cuda", LibraryFacts("other", {}), {"MV2_USE_CUDA": "1"}, False, "no CUDA"),
])
def test_gpu_awareness_per_vendor_library_first(vendor, facts, env, direct, reason):
    found = detect_gpu_aware("auto", vendor, facts, env)
    assert found.direct is direct and reason in found.reason


def test_open_mpi_reductions_on_device_memory_are_staged(fake):
    facts = LibraryFacts("open-mpi", {"MPIX_Query_cuda_support": 1})
    aware = detect_gpu_aware("auto", "cuda", facts, {})
    assert aware.direct and not aware.reductions and "reductions staged" in str(aware)
    assert detect_gpu_aware("yes", "cuda", facts, {}).reductions is False  # a library limit
    t = torch.ones(4)
    assert not MPIBuffer(t, fake, aware).staged  # point-to-point, gathers: direct
    assert MPIBuffer(t, fake, aware, reduction=True).staged


def test_forced_answers_and_host_memory():
    facts = LibraryFacts("mpich", MPICH_NO)
    assert detect_gpu_aware("yes", "cuda", facts, {}).direct
    assert not detect_gpu_aware("no", "cuda", LibraryFacts("mpich", {
        "MPIX_Query_cuda_support": 1}), {}).direct
    assert not detect_gpu_aware("auto", None, facts, {}).direct  # host memory
    with pytest.raises(ValueError):
        detect_gpu_aware("maybe", "cuda", facts, {})


def test_the_library_here_is_asked_and_says_no():
    # The PyPI MPICH is built without GPU support: the query must say so.
    found = detect_gpu_aware("auto", "cuda")
    assert not found.direct and "MPIX_Query_cuda_support() == 0" in found.reason
    assert library_family(MPI.Get_library_version()) in ("mpich", "open-mpi")
    assert library_family("CRAY MPICH version 8.1.28 (ANL base 3.4a2)") == "cray-mpich"


# ------------------------------------------------------------------ MPI thread level

def test_thread_level_is_checked_for_devices_whose_hooks_run_off_the_main_thread(fake):
    check_thread_level(Accelerator(), MPI.THREAD_SINGLE)  # CPU hooks run on the caller
    check_thread_level(fake, MPI.THREAD_SERIALIZED)
    with pytest.raises(UserError) as e:
        check_thread_level(fake, MPI.THREAD_FUNNELED)
    assert "MPI_THREAD_FUNNELED" in str(e.value) and "MPI_THREAD_SERIALIZED" in str(e.value)
    assert "export MPICH_MAX_THREAD_SAFETY=multiple" in str(e.value)  # Cray MPICH's cap
    assert "\n" not in str(e.value)


def test_world_on_the_fake_device():
    w = World.create(MPI.COMM_SELF, device="fake", gpu_aware="no")
    assert w.device == "cpu" and w.accel.kind == "fake" and not w.gpu_aware
    assert "fake:0" in w.describe() and "GPU-aware MPI: no" in w.describe()
    w.close()


# ------------------------------------------------------------- buffers on the fake device

def test_host_memory_is_a_numpy_view_and_device_memory_never_is(fake):
    a = np.arange(4, dtype=np.float32)
    assert MPIBuffer(a).obj is a
    t = torch.arange(4, dtype=torch.float32)
    buf = MPIBuffer(t)
    buf.to_mpi()[0] = 42.0
    assert t[0].item() == 42.0 and not buf.on_device
    d = torch.arange(4, dtype=torch.float32)
    direct = MPIBuffer(d, fake, YES)
    obj = direct.to_mpi()
    assert not isinstance(obj, np.ndarray) and obj.__dlpack_device__() == (2, 0)  # CUDA
    with pytest.raises(BufferError):  # mpi4py will not read it as host memory
        MPI.buffer(obj).tobytes()
    with pytest.raises(TypeError, match="fake device memory"):
        d.numpy()
    assert d.cpu().numpy()[1] == 1.0  # a copy first, as on a GPU
    assert fake.stats.numpy_on_device == 1


@pytest.mark.parametrize("aware", [YES, NO])
def test_device_buffers_reach_mpi_after_their_event(fake, aware):
    t = torch.arange(8, dtype=torch.float32)
    out = torch.zeros(8)
    src, dst = MPIBuffer(t, fake, aware), MPIBuffer(out, fake, aware)
    MPI.COMM_SELF.Sendrecv(src.to_mpi(), 0, 0, dst.to_mpi(send=False), 0, 0)
    dst.complete()
    assert torch.equal(out, t)
    s = fake.stats
    assert s.unready_handoffs == 0 and s.device_syncs == 0
    assert (s.staged_bytes > 0) is (not aware.direct)
    assert (s.direct_handoffs > 0) is aware.direct
    assert s.staged_bytes == (2 * 32 if not aware.direct else 0)  # in and out, no more


def test_a_buffer_handed_over_without_waiting_is_caught(fake):
    buf = MPIBuffer(torch.ones(2), fake, YES)
    obj = fake.for_mpi(buf.source, None)  # what skipping to_mpi()'s wait would give
    MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, obj, op=MPI.SUM)
    assert fake.stats.unready_handoffs == 1


def test_events_pass_in_order_and_one_wait_covers_a_batch(fake):
    bufs = [MPIBuffer(torch.ones(4), fake, YES) for _ in range(5)]
    for b in bufs:
        b.prepare()
    assert not bufs[0].ready() and bufs[0].ready()  # the device lags one check
    waits = fake.stats.event_waits
    objs = to_mpi_all(bufs)
    assert len(objs) == 5 and fake.stats.event_waits == waits + 1


def test_bf16_travels_as_its_bit_pattern(fake):
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    for accel, aware in ((None, NO), (fake, YES), (fake, NO)):
        dst = torch.zeros(2, dtype=torch.bfloat16)
        a, b = MPIBuffer(t, accel, aware), MPIBuffer(dst, accel, aware)
        MPI.COMM_SELF.Sendrecv(a.to_mpi(), 0, 0, b.to_mpi(send=False), 0, 0)
        b.complete()
        assert torch.equal(dst, t)


def test_non_contiguous_and_unknown_types_are_refused():
    with pytest.raises(ValueError, match="contiguous"):
        MPIBuffer(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="cannot communicate a list"):
        MPIBuffer([1, 2])


def test_backward_runs_on_a_thread_of_its_own_like_cuda_autograd(fake):
    w = torch.ones(3, requires_grad=True)
    threads = []
    w.register_post_accumulate_grad_hook(lambda p: threads.append(threading.current_thread()))
    fake.backward((w * 2).sum())
    assert threads and threads[0] is not threading.main_thread()
    assert torch.equal(w.grad, torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="does not require grad"):
        fake.backward(torch.ones(1).sum())  # the worker's error reaches the caller
    fake.synchronize()
    assert fake.stats.device_syncs == 1 and fake.stats.syncs_in_backward == 0
