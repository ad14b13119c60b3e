"""The doctor's checks of the communication layer: each rank's device and CPU affinity,
the MPI library and its thread level, GPU-aware MPI per vendor, allreduce of host and
device buffers, and a bf16 round trip between rank pairs. Each is collective over the
world, and every wait has a deadline."""

from __future__ import annotations

import os
import socket

import torch

from hpctrain.comm.buffers import MPIBuffer
from hpctrain.comm.device import Accelerator
from hpctrain.comm.gpu_aware import HOST_MEMORY, QUERIES, VENDOR_NAMES, detect_gpu_aware
from hpctrain.comm.mpi import MPI
from hpctrain.comm.placement import VISIBILITY_ENV
from hpctrain.comm.transport import MPITransport, resolve_collectives
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import THREAD_LEVELS, World
from hpctrain.doctor.node_check import NodeCheck
from hpctrain.sizes import MiB
from hpctrain.doctor.setup_checks import (expand_cpus, gpu_numa_cpus, gpus_present,
                                          torch_gpu_build)

FAULT_ENV = "HPCTRAIN_DOCTOR_FAULT"


def planted_fault(check: str) -> bool:
    """Whether ``HPCTRAIN_DOCTOR_FAULT`` asks for a fault in ``check`` (for the tests)."""
    return os.environ.get(FAULT_ENV, "") == check


def agree(world: World, ok: bool, what: str) -> bool:
    """True when ``ok`` on every rank."""
    buf = torch.tensor([int(ok)], dtype=torch.int64)
    req = world.comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.MIN)
    wait_all([req], timeout=world.timeout, what=f"doctor: agreeing on {what}")
    return bool(buf[0])


def _cpu_list(cpus) -> str:
    """``{0,1,2,5}`` -> ``0-2,5``."""
    cpus, out, i = sorted(cpus), [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def check_ranks(world: World, result: NodeCheck) -> None:
    accel = world.accel
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    masks = [f"{k}={os.environ[k]}" for ks in VISIBILITY_ENV.values() for k in ks
             if k in os.environ]
    gpu_cpus = gpu_numa_cpus(accel) if accel.is_accelerator else None
    mine = {"rank": world.rank, "host": socket.gethostname(), "node": world.node,
            "local_rank": world.local_rank, "device": accel.describe(), "kind": accel.kind,
            "device_id": accel.identity(), "cpus": _cpu_list(affinity),
            "n_cpus": len(affinity), "gpu_cpus": _cpu_list(gpu_cpus) if gpu_cpus else "",
            "gpu_files": gpus_present(), "torch_gpu": torch_gpu_build(),
            "visibility": " ".join(masks), "torch_threads": torch.get_num_threads()}
    rows = world.comm.gather(mine, root=0)
    if world.is_root:
        result.sections["ranks"] = rows
        # Ranks of one node on overlapping cores slow each other down: say so, not fail.
        seen: dict = {}
        for r in rows:
            seen.setdefault(r["host"], []).append(r)
        overlaps = [f"{a['rank']}&{b['rank']}" for rs in seen.values()
                    for i, a in enumerate(rs) for b in rs[i + 1:]
                    if expand_cpus(a["cpus"]) & expand_cpus(b["cpus"])]
        result.sections["ranks_note"] = ("ranks sharing cores: " + ", ".join(overlaps[:8])
                                         if overlaps else "")


def check_mpi(world: World, result: NodeCheck) -> None:
    import mpi4py

    provided = MPI.Query_thread()
    need = MPI.THREAD_SERIALIZED if world.accel.hooks_off_main_thread else MPI.THREAD_SINGLE
    ok = provided >= need
    result.sections["mpi"] = {
        "library": " ".join(MPI.Get_library_version().split("\n")[0].split()),
        "standard": "%d.%d" % MPI.Get_version(), "mpi4py": mpi4py.__version__,
        "thread_level": THREAD_LEVELS.get(provided, str(provided)),
        "thread_level_needed": THREAD_LEVELS[need], "ok": ok}
    if not ok:
        result.fail("mpi", f"thread level {THREAD_LEVELS.get(provided)} is below "
                           f"{THREAD_LEVELS[need]}, which {world.accel.kind} needs")
    vendors = {}
    for vendor in QUERIES:  # what the library says about each vendor, whatever this node has
        answer = detect_gpu_aware("auto", vendor)
        vendors[VENDOR_NAMES[vendor]] = {"aware": answer.direct, "reason": answer.reason,
                                         "reductions": answer.reductions}
    result.sections["gpu_aware"] = {"per_vendor": vendors,
                                    "this_device": str(world.gpu_aware)
                                    if world.accel.is_accelerator else "host memory only",
                                    "device_vendor": world.accel.vendor}


def _allreduce_row(world: World, nbytes: int, on_device: bool, transport) -> dict:
    """Sum of ``rank + 1`` over every rank in fp32 (exact) through ``transport``, checked
    and timed."""
    accel, n = world.accel, world.size
    count = max(1, nbytes // 4)
    dev = accel.torch_device if on_device else torch.device("cpu")
    x = torch.empty(count, dtype=torch.float32, device=dev)
    buf = transport.buffer(x, reduction=True)
    iters = max(2, min(20, int(200 * MiB // max(nbytes, 1))))

    def once() -> None:
        buf.prepare()
        wait_all([transport.allreduce(buf)], timeout=world.timeout,
                 what=f"doctor: allreduce of {nbytes} bytes")
        buf.complete()

    x.fill_(world.rank + 1)
    once()  # warm-up, and the checked result
    if planted_fault("allreduce") and world.rank == 0:
        x[count // 2] += 1  # planted: one wrong element
    expect = n * (n + 1) / 2
    bad = int((x != expect).sum().item())
    world.comm.Barrier()
    t0 = MPI.Wtime()
    for _ in range(iters):
        once()
    if on_device:
        accel.synchronize()  # the last operation on the device: timed, outside any step
    seconds = (MPI.Wtime() - t0) / iters
    seconds = world.comm.allreduce(seconds, op=MPI.MAX)
    alg = count * 4 / seconds / 1e9
    return {"bytes": count * 4, "wrong_elements": bad, "iters": iters,
            "time_ms": seconds * 1e3, "algbw_GBps": alg,
            # nccl-tests' bus bandwidth: what each link carries in a ring, 2(n-1)/n
            "busbw_GBps": alg * 2 * (n - 1) / n if n > 1 else alg,
            "staged": buf.staging_nbytes > 0}


def transports(world: World) -> list[tuple[str, str, object]]:
    """``(memory, transport label, transport)`` for every allreduce row: host memory
    through MPI, device memory through MPI (direct or staged) and, where the device's
    collective library is there and several ranks share the work, through it."""
    accel = world.accel
    rows = [("host", "mpi", MPITransport(world.comm, Accelerator(), HOST_MEMORY))]
    if not accel.is_accelerator:
        return rows
    rows.append(("device", "mpi", MPITransport(world.comm, accel, world.gpu_aware)))
    from hpctrain.comm import device_collectives
    from hpctrain.comm.xccl_transport import XcclTransport

    # NCCL refuses two ranks on one GPU (its "Duplicate GPU" error): the set-up check
    # names that mistake, and the library's rows wait for a node set up right.
    if (world.size > 1 and world.devices == world.size
            and device_collectives.backend_for(accel.kind)):
        resolve_collectives("xccl", world.comm, accel, world.timeout)
        library = XcclTransport(world.comm, accel)
        rows.append(("device", library.name, library))
    return rows


def check_allreduce(world: World, result: NodeCheck, sizes_mib) -> None:
    rows = []
    for memory, label, transport in transports(world):
        for size in sizes_mib:
            row = {"size_mib": size, "memory": memory, "transport": label}
            row.update(_allreduce_row(world, int(size * MiB), memory == "device", transport))
            ok = agree(world, row["wrong_elements"] == 0, "allreduce results")
            row["status"] = "ok" if ok else "WRONG"
            if not ok:
                result.fail("allreduce", f"{memory} buffer of {size:g} MiB through {label}: "
                                         "the sum differs from the expected one on some rank")
            rows.append(row)
    if not world.accel.is_accelerator:
        rows.append({"memory": "device", "status": "no accelerator"})
    result.sections["allreduce"] = rows


def check_p2p(world: World, result: NodeCheck, nbytes: int) -> None:
    """bf16 from each even rank to the next odd one and back (the pipeline's sends)."""
    accel, rank, n = world.accel, world.rank, world.size
    if n < 2:
        result.sections["p2p"] = {"status": "skipped: one rank"}
        return
    count = max(1, nbytes // 2)
    dev = accel.torch_device
    pattern = torch.arange(count, dtype=torch.float32).remainder_(251).to(torch.bfloat16)
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    ok, seconds = True, 0.0
    if peer < n:
        x = pattern.to(dev, copy=True) if rank % 2 == 0 else \
            torch.empty(count, dtype=torch.bfloat16, device=dev)
        buf = MPIBuffer(x, accel, world.gpu_aware)
        t0 = MPI.Wtime()
        for turn in (0, 1):  # even sends then receives; odd receives then sends
            sending = (rank % 2 == 0) == (turn == 0)
            if not sending:
                req = world.comm.Irecv(buf.to_mpi(send=False), source=peer, tag=17)
                wait_all([req], timeout=world.timeout, what="doctor: bf16 receive")
                buf.complete()
                if rank % 2 == 1 and planted_fault("p2p"):
                    x[0] += 1  # planted: the echo differs
            else:
                req = world.comm.Isend(buf.to_mpi(), dest=peer, tag=17)
                wait_all([req], timeout=world.timeout, what="doctor: bf16 send")
        if accel.is_accelerator:
            accel.synchronize()
        seconds = MPI.Wtime() - t0
        if rank % 2 == 0:
            ok = torch.equal(x.cpu().view(torch.int16), pattern.view(torch.int16))
    times = world.comm.gather(seconds, root=0)
    good = agree(world, ok, "bf16 round trips")
    pairs = [(r, r + 1) for r in range(0, n - 1, 2)]
    result.sections["p2p"] = {
        "bytes": count * 2, "pairs": pairs, "memory": "device" if accel.is_accelerator
        else "host", "status": "ok" if good else "WRONG",
        "round_trip_ms": max(times) * 1e3 if times else None}
    if not good:
        result.fail("p2p", "a bf16 round trip came back different")
