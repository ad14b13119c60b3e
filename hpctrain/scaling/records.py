"""One JSON record per run of a study point: what ran, where, and what it measured.

A record is built from the trainer's ``summary.json`` (the same whether the run was
local or a batch job), plus the study's view of the point and the model's prediction
made before the run. Failed runs are records too (``status = "failed"`` and the error).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

import numpy

SCHEMA = 1


def git_state(folder: str | os.PathLike | None = None) -> dict:
    """The commit of the hpctrain checkout and whether it has uncommitted changes."""
    folder = folder or Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {"sha": None, "dirty": None}
    return {"sha": sha or None, "dirty": bool(dirty) if sha else None}


def environment() -> dict:
    """Where the study ran: host, CPU, libraries (the numbers depend on all of them)."""
    import torch  # heavy, and only the runner asks: not at every `hpctrain scale` start

    try:  # importing mpi4py.MPI initializes MPI: only here, never at import time
        import mpi4py
        from mpi4py import MPI  # noqa: F401  (the library version below needs it loaded)

        mpi = MPI.Get_library_version().splitlines()[0].strip()
        mpi4py_version = mpi4py.__version__
    except Exception:  # noqa: BLE001 - an environment report must not fail the study
        mpi, mpi4py_version = None, None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": socket.gethostname(), "platform": platform.platform(),
            "cpu": cpu_model(), "cores": cores, "python": platform.python_version(),
            "torch": torch.__version__, "numpy": numpy.__version__, "mpi4py": mpi4py_version,
            "mpi": mpi, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cuda": torch.cuda.is_available()}


def cpu_model() -> str:
    """The processor's name (Linux /proc/cpuinfo), for records and benchmark results."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def from_summary(summary: dict, *, peak_flops: float | None = None) -> dict:
    """The measured part of a record, from a trainer's ``summary.json``.

    Throughput comes from the median step time (after the trainer's warm-up), not from
    the whole run's mean, so a slow first step does not count."""
    timing = summary.get("timing") or {}
    cfg = summary.get("config", {})
    ranks = int(summary["world_size"])
    median_ms = timing.get("step_ms_median")
    tokens_per_step = cfg["train"]["batch_size"] * cfg["model"]["block_size"]
    tok_s = tokens_per_step / (median_ms / 1e3) if median_ms else None
    flops = summary.get("flops_per_token")
    per_rank_flops = flops * tok_s / ranks if tok_s and flops else None
    peak = peak_flops or (summary["peak_tflops"] * 1e12 if summary.get("peak_tflops") else None)
    return {"step_ms_median": median_ms, "step_ms_p90": timing.get("step_ms_p90"),
            "warmup_steps": timing.get("warmup_steps"),
            "measured_steps": timing.get("measured_steps"),
            "tokens_per_s": tok_s, "tokens_per_s_per_rank": tok_s / ranks if tok_s else None,
            "tflops_per_rank": per_rank_flops / 1e12 if per_rank_flops else None,
            "mfu": per_rank_flops / peak if per_rank_flops and peak else None,
            "shares": timing.get("shares"), "peak_rss_bytes_max_rank":
                summary.get("peak_rss_bytes_max_rank"),
            "memory_per_rank": summary.get("memory_per_rank"),
            "params": summary.get("params"), "flops_per_token": flops,
            "world_size": ranks, "wall_s": summary.get("wall_s")}


def record_path(folder: Path, point_id: str, repeat: int) -> Path:
    return folder / "records" / f"{point_id}-r{repeat}.json"


def write_record(path: Path, record: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, path)  # a report never reads half a record
    return path


def read_records(folder: str | os.PathLike) -> list[dict]:
    """Every record under ``folder/records``, in the order the study ran them."""
    files = sorted(Path(folder).glob("records/*.json"))
    records = []
    for f in files:
        try:
            r = json.loads(f.read_text())
        except json.JSONDecodeError:
            continue  # a run killed while writing; the study marks it failed elsewhere
        if r.get("schema") == SCHEMA:
            records.append(r)
    return sorted(records, key=lambda r: (r.get("index", 0), r.get("repeat", 0)))


def busy_cores(interval_s: float = 0.5) -> float | None:
    """Cores kept busy by other processes right now (from /proc/stat; None elsewhere).

    A study on a shared machine measures whatever else runs there too: each record keeps
    this number from just before its run, and the runner can wait for a quiet machine."""
    def sample():
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        values = [int(v) for v in fields]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values), idle

    try:
        t0, i0 = sample()
        time.sleep(interval_s)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    ticks = max(1, t1 - t0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0.0, (1.0 - (i1 - i0) / ticks) * (cores or 1))


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
