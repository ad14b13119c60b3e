"""Measure collectives under ``mpiexec`` for ``hpctrain scale calibrate`` (one group size).

    mpiexec -n 4 python -m hpctrain.scaling.calib_worker --output fits.json

Times ``Allreduce``, ``Reduce_scatter_block``, ``Allgather``, a neighbour exchange and,
where the ranks share a node, the shared-memory gradient allreduce, as mpi4py's
benchmarks do (``Barrier``, ``Wtime``, after warm-up; the slowest rank counts), and fits
``t = alpha + beta * bytes`` per collective. ``--busy-ms`` adds computation before each call.
How and why: docs/design/scaling-model.md ("``scale calibrate``").
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hpctrain.comm.mpi import MPI
from hpctrain.comm.watchdog import wait_all
from hpctrain.model.shape import GPTConfig

SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
"""Bytes: 64 KiB to 16 MiB (the trainer's first bucket is 1 MiB, the others 25 MiB)."""


def config_from_key(shape_key: str):
    """The model a ``ModelShape.key`` names: ``L4-H4-C128-T64-V65`` (GPT-2), with
    ``-llama-KV2-F352`` after it for a Llama."""
    parts = shape_key.split("-")
    L, H, C, T, V = (int(x[1:]) for x in parts[:5])
    extra = {}
    if len(parts) == 8:
        extra = {"arch": parts[5], "n_kv_head": int(parts[6][2:]), "ffn_hidden": int(parts[7][1:])}
    return GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, **extra)


def _busy(seconds: float) -> None:
    """CPU work standing in for forward/backward before a collective."""
    a = np.full((64, 64), 0.5, dtype=np.float32)  # fixed operands: no denormals creep in
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def measure(comm, kind: str, n_bytes: int, reps: int, busy_s: float) -> float:
    p, rank = comm.Get_size(), comm.Get_rank()
    count = max(p, n_bytes // 4 // p * p)
    send = np.ones(count, dtype=np.float32)
    recv = np.empty(count, dtype=np.float32)
    part = np.empty(count // p, dtype=np.float32)
    right, left = (rank + 1) % p, (rank - 1) % p

    arena = None
    if kind == "shm_allreduce":
        # torch (under shm_allreduce) only for this kind: the MPI timings need numpy alone.
        from hpctrain.comm.shm_allreduce import SharedMemoryAllreduce

        arena = SharedMemoryAllreduce(comm, [count])
        arena.flat(0).fill_(1.0)

    def call():
        if arena is not None:
            wait_all([arena.start(0)], timeout=60, what="shared-memory allreduce")
        elif kind == "allreduce":
            comm.Allreduce(send, recv, op=MPI.SUM)
        elif kind == "reduce_scatter":
            comm.Reduce_scatter_block(send, part, op=MPI.SUM)
        elif kind == "allgather":
            comm.Allgather(send[: count // p], recv)
        else:
            comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)

    times = []
    for i in range(reps + 2):
        comm.Barrier()
        _busy(busy_s)
        t0 = MPI.Wtime()
        call()
        t = MPI.Wtime() - t0
        if i >= 2:  # warm-up: first calls set up connections and buffers
            times.append(comm.allreduce(t, op=MPI.MAX))
    if arena is not None:
        arena.close()
    return float(np.median(times))


def fit_line(sizes, times) -> tuple[float, float]:
    """Least squares ``t = alpha + beta * n``, alpha and beta kept >= 0."""
    x, y = np.asarray(sizes, float), np.asarray(times, float)
    beta, alpha = np.polyfit(x, y, 1)
    if alpha < 0:  # the latency is below resolution: the line through the origin
        alpha, beta = 0.0, float((x @ y) / (x @ x))
    return float(max(alpha, 0.0)), float(max(beta, 0.0))


def concurrent_compute(comm, shape_key: str, rows: int, reps: int) -> float:
    """Seconds per forward + backward of a shape while every rank computes at once, each
    followed by a one-number allreduce as a training step ends in its gradient reduction:
    what sharing the node's cores costs a rank, including waiting for the partner the
    OS had descheduled (MPICH's waiting ranks spin, taking cycles from those computing)."""
    import torch  # heavy: only with --compute

    from hpctrain.model.gpt import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = config_from_key(shape_key)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size))
    flag = np.zeros(1)
    times = []
    comm.Barrier()
    for i in range(reps + 1):
        t0 = time.perf_counter()
        model(x, x).backward()
        comm.Allreduce(MPI.IN_PLACE, flag)
        if i:  # the first step warms up allocator and kernels
            times.append(time.perf_counter() - t0)
    return float(np.median(comm.allgather(float(np.median(times)))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--busy-ms", type=float, default=0.0,
                    help="computation before each call (ms); 0 times the library alone")
    ap.add_argument("--compute", metavar="SHAPE", action="append", default=[],
                    help="also time forward + backward of this model shape (calibration key "
                         "L4-H4-C128-T128-V96) on all ranks at once")
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    result = {"ranks": comm.Get_size(), "points": {}, "fits": {}, "compute_s": {}}
    for key in args.compute:
        result["compute_s"][key] = concurrent_compute(comm, key, args.rows, args.reps)
    from hpctrain.comm.shm_allreduce import use_shared_memory  # imports torch

    kinds = ["allreduce", "reduce_scatter", "allgather", "p2p"]
    if use_shared_memory("auto", comm, "cpu", [max(SIZES) // 4]):
        kinds.append("shm_allreduce")
    for kind in kinds:
        times = [measure(comm, kind, n, args.reps, args.busy_ms / 1e3) for n in SIZES]
        alpha, beta = fit_line(SIZES, times)
        result["points"][kind] = dict(zip(map(str, SIZES), times))
        result["fits"][kind] = {"alpha_us": alpha * 1e6, "ns_per_byte": beta * 1e9}
    if comm.Get_rank() == 0:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
