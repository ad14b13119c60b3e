"""``hpctrain doctor``: an acceptance check of one node, run before training on it.

    mpiexec -n 4 hpctrain doctor --json doctor.json

Each rank reports its device and CPU affinity; then the MPI library and its thread level,
whether it is GPU-aware per vendor and why (``comm/gpu_aware.py``), allreduce of host and
device buffers (checked and timed at 1, 25 and 150 MiB), a bf16 round trip between rank
pairs (the pipeline's point-to-point path, on the device when there is one) and one GPT
training step (tokens/s and MFU where the device's peak is known). Rank 0 prints the
report and writes it as JSON; the exit status is 1 when any check failed, naming it.

Every verdict is agreed by all ranks (a check fails when it fails on any rank), and every
wait has a deadline (``watchdog.wait_all``), so a broken node ends the job with a message
instead of hanging it. ``HPCTRAIN_DOCTOR_FAULT=allreduce|p2p|train`` plants a fault in
that check (for the tests that prove a failure is reported).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from mpi4py import MPI

from hpctrain.comm.buffers import MPIBuffer
from hpctrain.comm.gpu_aware import HOST_MEMORY, QUERIES, VENDOR_NAMES, detect_gpu_aware
from hpctrain.comm.placement import VISIBILITY_ENV
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import THREAD_LEVELS, World
from hpctrain.systems.registry import peak_for_device

MiB = 2**20
DEFAULT_SIZES_MIB = (1.0, 25.0, 150.0)
MODELS = ("auto", "small", "gpt2-124m")
# GPT-2 124M as trained (vocabulary padded to a multiple of 64), and a CPU-sized one.
SHAPES = {"gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024,
                            vocab_size=50304, batch_per_rank=8),
          "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256,
                        batch_per_rank=8)}
FAULT_ENV = "HPCTRAIN_DOCTOR_FAULT"
SECTIONS = ("ranks", "mpi", "gpu_aware", "allreduce", "p2p", "train")


@dataclass
class Report:
    sections: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    """``"check: why"`` for each failed check."""

    def fail(self, check: str, why: str) -> None:
        self.failures.append(f"{check}: {why}")

    def to_dict(self) -> dict:
        return {**self.sections, "failures": self.failures, "ok": not self.failures}


def _agree(world: World, ok: bool, what: str) -> bool:
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


def check_ranks(world: World, report: Report) -> None:
    accel = world.accel
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    masks = [f"{k}={os.environ[k]}" for ks in VISIBILITY_ENV.values() for k in ks
             if k in os.environ]
    mine = {"rank": world.rank, "host": socket.gethostname(), "node": world.node,
            "local_rank": world.local_rank, "device": accel.describe(), "kind": accel.kind,
            "cpus": _cpu_list(affinity), "n_cpus": len(affinity),
            "visibility": " ".join(masks), "torch_threads": torch.get_num_threads()}
    rows = world.comm.gather(mine, root=0)
    if world.is_root:
        report.sections["ranks"] = rows
        # Ranks of one node on overlapping cores slow each other down: say so, not fail.
        seen: dict = {}
        for r in rows:
            seen.setdefault(r["host"], []).append(r)
        overlaps = [f"{a['rank']}&{b['rank']}" for rs in seen.values()
                    for i, a in enumerate(rs) for b in rs[i + 1:]
                    if set(_expand(a["cpus"])) & set(_expand(b["cpus"]))]
        report.sections["ranks_note"] = ("ranks sharing cores: " + ", ".join(overlaps[:8])
                                         if overlaps else "")


def _expand(text: str) -> list[int]:
    out = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def check_mpi(world: World, report: Report) -> None:
    import mpi4py

    provided = MPI.Query_thread()
    need = MPI.THREAD_SERIALIZED if world.accel.hooks_off_main_thread else MPI.THREAD_SINGLE
    ok = provided >= need
    report.sections["mpi"] = {
        "library": " ".join(MPI.Get_library_version().split("\n")[0].split()),
        "standard": "%d.%d" % MPI.Get_version(), "mpi4py": mpi4py.__version__,
        "thread_level": THREAD_LEVELS.get(provided, str(provided)),
        "thread_level_needed": THREAD_LEVELS[need], "ok": ok}
    if not ok:
        report.fail("mpi", f"thread level {THREAD_LEVELS.get(provided)} is below "
                           f"{THREAD_LEVELS[need]}, which {world.accel.kind} needs")
    vendors = {}
    for vendor in QUERIES:  # what the library says about each vendor, whatever this node has
        answer = detect_gpu_aware("auto", vendor)
        vendors[VENDOR_NAMES[vendor]] = {"aware": answer.direct, "reason": answer.reason,
                                         "reductions": answer.reductions}
    report.sections["gpu_aware"] = {"per_vendor": vendors,
                                    "this_device": str(world.gpu_aware)
                                    if world.accel.is_accelerator else "host memory only",
                                    "device_vendor": world.accel.vendor}


def _fault(check: str) -> bool:
    return os.environ.get(FAULT_ENV, "") == check


def _allreduce_row(world: World, nbytes: int, on_device: bool) -> dict:
    """Sum of ``rank + 1`` over every rank in fp32 (exact), checked and timed."""
    accel, n = world.accel, world.size
    count = max(1, nbytes // 4)
    dev = accel.torch_device if on_device else torch.device("cpu")
    x = torch.empty(count, dtype=torch.float32, device=dev)
    buf = MPIBuffer(x, accel if on_device else None,
                    world.gpu_aware if on_device else HOST_MEMORY, reduction=True)
    iters = max(2, min(20, int(200 * MiB // max(nbytes, 1))))

    def once() -> None:
        req = world.comm.Iallreduce(MPI.IN_PLACE, buf.to_mpi(), op=MPI.SUM)
        wait_all([req], timeout=world.timeout, what=f"doctor: allreduce of {nbytes} bytes")
        buf.from_mpi()

    x.fill_(world.rank + 1)
    once()  # warm-up, and the checked result
    if _fault("allreduce") and world.rank == 0:
        x[count // 2] += 1  # planted: one wrong element
    expect = n * (n + 1) / 2
    bad = int((x != expect).sum().item())
    world.comm.Barrier()
    t0 = MPI.Wtime()
    for _ in range(iters):
        once()
    if on_device:
        accel.synchronize()  # the last copy back: timed, outside any step
    seconds = (MPI.Wtime() - t0) / iters
    seconds = world.comm.allreduce(seconds, op=MPI.MAX)
    alg = count * 4 / seconds / 1e9
    return {"bytes": count * 4, "wrong_elements": bad, "iters": iters,
            "time_ms": seconds * 1e3, "algbw_GBps": alg,
            # nccl-tests' bus bandwidth: what each link carries in a ring, 2(n-1)/n
            "busbw_GBps": alg * 2 * (n - 1) / n if n > 1 else alg,
            "staged": buf.staged}


def check_allreduce(world: World, report: Report, sizes_mib) -> None:
    rows = []
    for size in sizes_mib:
        nbytes = int(size * MiB)
        for memory in ("host", "device"):
            row = {"size_mib": size, "memory": memory}
            if memory == "device" and not world.accel.is_accelerator:
                row["status"] = "no accelerator"
                rows.append(row)
                continue
            row.update(_allreduce_row(world, nbytes, memory == "device"))
            ok = _agree(world, row["wrong_elements"] == 0, "allreduce results")
            row["status"] = "ok" if ok else "WRONG"
            if not ok:
                report.fail("allreduce", f"{memory} buffer of {size:g} MiB: the sum differs "
                                         "from the expected one on some rank")
            rows.append(row)
    report.sections["allreduce"] = rows


def check_p2p(world: World, report: Report, nbytes: int) -> None:
    """bf16 from each even rank to the next odd one and back (the pipeline's sends)."""
    accel, rank, n = world.accel, world.rank, world.size
    if n < 2:
        report.sections["p2p"] = {"status": "skipped: one rank"}
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
                buf.from_mpi()
                if rank % 2 == 1 and _fault("p2p"):
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
    good = _agree(world, ok, "bf16 round trips")
    pairs = [(r, r + 1) for r in range(0, n - 1, 2)]
    report.sections["p2p"] = {
        "bytes": count * 2, "pairs": pairs, "memory": "device" if accel.is_accelerator
        else "host", "status": "ok" if good else "WRONG",
        "round_trip_ms": max(times) * 1e3 if times else None}
    if not good:
        report.fail("p2p", "a bf16 round trip came back different")


def check_train(world: World, report: Report, model: str) -> None:
    """One step of GPT training with the trainer's pieces (``parallelize``, engine,
    runner) on random tokens: a warm-up step, then a timed one."""
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.config import load_config
    from hpctrain.model.gpt import GPT
    from hpctrain.parallel.parallelize import parallelize

    accel = world.accel
    name = model if model != "auto" else ("gpt2-124m" if accel.kind in ("cuda", "xpu")
                                          else "small")
    shape = dict(SHAPES[name])
    per_rank = shape.pop("batch_per_rank")
    dtype = "bf16" if accel.kind in ("cuda", "xpu") else "fp32"
    cfg = load_config("default", [f"--model.{k}={v}" for k, v in shape.items()] + [
        f"--train.batch_size={per_rank * world.size}", f"--train.dtype={dtype}",
        f"--train.device={accel.kind}"])
    gpt_cfg = cfg.model.to_gpt()
    grid = ProcessGrid.create(world, 1)
    torch.manual_seed(0)
    par = parallelize(GPT(gpt_cfg), grid, cfg)
    gen = torch.Generator().manual_seed(1 + world.rank)
    T = gpt_cfg.block_size
    losses, seconds = [], 0.0
    for step in range(2):
        tokens = torch.randint(0, gpt_cfg.vocab_size, (per_rank, T + 1), generator=gen)
        x = accel.to_device(tokens[:, :-1].contiguous())
        y = accel.to_device(tokens[:, 1:].contiguous())
        world.comm.Barrier()
        t0 = time.perf_counter()
        loss = par.runner.train_step([x], [y], par.engine.grad_scale,
                                     par.engine.prepare_for_backward)
        par.engine.finish()
        norm = float(par.engine.step(cfg.optim.lr, cfg.optim.grad_clip))
        par.runner.tie_weights()
        par.engine.zero_grad()
        losses.append(float(loss))  # synchronizes the device: the step is done
        seconds = world.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    par.engine.close()
    if _fault("train"):
        losses[-1] = float("nan")
    ok = _agree(world, all(math.isfinite(v) for v in losses) and math.isfinite(norm),
                "the training step")
    tokens_per_s = per_rank * world.size * T / seconds
    peak = peak_for_device(accel.name, dtype)
    mfu = (gpt_cfg.flops_per_token() * tokens_per_s / (peak * 1e12 * world.size)
           if peak else None)
    report.sections["train"] = {
        "model": name, "params": gpt_cfg.num_params(), "dtype": dtype,
        "batch_per_rank": per_rank, "block_size": T, "losses": losses,
        "step_s": seconds, "tokens_per_s": tokens_per_s, "peak_tflops": peak, "mfu": mfu,
        "memory": accel.describe_memory(), "status": "ok" if ok else "FAILED"}
    if not ok:
        report.fail("train", f"the loss or gradient norm is not finite ({losses})")


def run_doctor(world: World, *, sizes_mib=DEFAULT_SIZES_MIB, model: str = "auto",
               json_path: str | None = None, out=print) -> int:
    """Run every check (collective over ``world``); rank 0 prints the report with
    ``out`` and writes ``json_path``. Returns 0 when every check passed, else 1."""
    report = Report()
    check_ranks(world, report)
    check_mpi(world, report)
    check_allreduce(world, report, sizes_mib)
    check_p2p(world, report, int(min(sizes_mib) * MiB))
    check_train(world, report, model)
    if world.is_root:
        report.sections["world"] = {"size": world.size, "nodes": world.n_nodes,
                                    "device": world.accel.kind}
        for line in format_report(report):
            out(line)
        if json_path:
            path = Path(json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return 1 if world.comm.bcast(bool(report.failures), root=0) else 0


def format_report(report: Report) -> list[str]:
    s = report.sections
    w = s["world"]
    lines = [f"hpctrain doctor: {w['size']} rank(s) on {w['nodes']} node(s), device "
             f"{w['device']}", "", "ranks:"]
    for r in s["ranks"]:
        vis = f"  {r['visibility']}" if r["visibility"] else ""
        lines.append(f"  rank {r['rank']:>3} {r['host']} local {r['local_rank']}: "
                     f"{r['device']}, cpus {r['cpus']} ({r['n_cpus']}){vis}")
    if s.get("ranks_note"):
        lines.append(f"  note: {s['ranks_note']}")
    m = s["mpi"]
    lines += ["", f"MPI: {m['library']} (MPI {m['standard']}, mpi4py {m['mpi4py']})",
              f"  thread level {m['thread_level']} (needs {m['thread_level_needed']}): "
              f"{'ok' if m['ok'] else 'FAILED'}", "GPU-aware MPI:"]
    for vendor, a in s["gpu_aware"]["per_vendor"].items():
        lines.append(f"  {vendor:<10} {'yes' if a['aware'] else 'no'} ({a['reason']})")
    lines.append(f"  this device: {s['gpu_aware']['this_device']}")
    lines += ["", "allreduce (fp32 sum):",
              f"  {'size':>8} {'memory':<7} {'status':<15} {'ms':>9} {'algbw GB/s':>11} "
              f"{'busbw GB/s':>11}"]
    for r in s["allreduce"]:
        head = f"  {r['size_mib']:>5g} MiB {r['memory']:<7} {r['status']:<15}"
        if "time_ms" in r:
            head += (f" {r['time_ms']:>9.3f} {r['algbw_GBps']:>11.2f} {r['busbw_GBps']:>11.2f}"
                     + ("  (staged via host)" if r["staged"] else ""))
        lines.append(head.rstrip())
    p = s["p2p"]
    if "bytes" in p:
        lines += ["", f"bf16 round trip ({p['memory']} memory, {p['bytes'] / MiB:g} MiB, "
                      f"pairs {' '.join(f'{a}<->{b}' for a, b in p['pairs'])}): "
                      f"{p['status']}, {p['round_trip_ms']:.2f} ms"]
    else:
        lines += ["", f"bf16 round trip: {p['status']}"]
    t = s["train"]
    mfu = f", MFU {100 * t['mfu']:.1f}%" if t["mfu"] is not None else \
        ", MFU n/a (peak of this device unknown)"
    lines += ["", f"training step: {t['model']} ({t['params'] / 1e6:.1f}M parameters, "
                  f"{t['dtype']}, {t['batch_per_rank']}x{t['block_size']} tokens per rank): "
                  f"{t['status']}, loss {t['losses'][-1]:.3f}, {t['step_s'] * 1e3:.0f} ms, "
                  f"{t['tokens_per_s']:,.0f} tokens/s{mfu}"]
    if t["memory"]:
        lines.append(f"  {t['memory']}")
    lines.append("")
    if report.failures:
        lines += ["FAILED:"] + [f"  {f}" for f in report.failures]
    else:
        lines.append("all checks passed")
    return lines
