"""Data reading: our collective MPI-IO reads against nanoGPT's np.memmap reads, and the
share of training time spent waiting for data.

1. Read bandwidth at GPT-2-like sizes: a 1 GiB token file (uint16, vocabulary 50257),
   samples of 1024 + 1 tokens at random offsets, 16 samples per rank per step, at 1, 2
   and 4 ranks. Each step every rank builds the int64 (x, y) batch from its samples:
     MPI-IO     hpctrain's reader (one Read_at_all per sample, ROMIO defaults of
                hpctrain) and the x/y split the trainer does
     memmap     nanoGPT's get_batch: a fresh np.memmap of the split per batch, x and y
                sliced per sample, astype(int64), torch.stack (its train.py, verbatim
                in spirit)
     memmap+R   the same with madvise(MADV_RANDOM): no fault read-around (which reads
                read_ahead_kb around every fault, 8 MiB on the development VM)
     view       for the record: MPI-IO with one Read_at_all per step through an indexed
                file view (the alternative hpctrain measured and did not keep)
   Aggregate bandwidth = useful token bytes read by all ranks / wall time (Barrier +
   Wtime around the steps). The methods alternate inside one mpiexec run, several
   rounds, median of the rounds. Warm: the file is in the page cache. Cold: the page
   cache is dropped before each method's pass (needs root; skipped otherwise).
   Where Open MPI is present (this Python's mpi4py is built on it, or `.venv-openmpi`
   from `make test-openmpi` exists), MPI-IO and memmap are measured again under Open
   MPI with each of its MPI-IO components: OMPIO (its default, which ignores ROMIO's
   hints) and ROMIO (`OMPI_MCA_io=^ompio`), warm, at 2 and 4 ranks.
2. Data wait during training: `shakespeare-char` on 2 ranks for 300 steps, data_ms /
   step_ms from metrics.jsonl (DLIO's accelerator utilization is 1 - this share), for
   the default reader (MPI-IO with prefetch) and, in the same run, without prefetch
   and with the memory-map reader.

Targets: MPI-IO >= 0.8x memmap bandwidth; data wait < 2% of step time.

    python perf/bench_io.py --shakespeare PATH [--quick] [--keep]
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import sys
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (ROOT, bench_parser, fmt, launch_env, mpiexec,  # noqa: E402
                         print_table, run_worker, shakespeare_dataset, worker_args,
                         write_result)

TOKENS = 512 << 20  # 1 GiB of uint16
BLOCK, PER_RANK = 1024, 16
SCRATCH = Path(os.environ.get("HPCTRAIN_BENCH_DIR", "/tmp/hpctrain-bench-io"))
OPENMPI_VENV = ROOT / ".venv-openmpi"  # make test-openmpi builds it
OPENMPI_COMPONENTS = {"OMPIO (default)": {},
                      "ROMIO (OMPI_MCA_io=^ompio)": {"OMPI_MCA_io": "^ompio"}}
DROP_CACHES = "/proc/sys/vm/drop_caches"


# -------------------------------------------------------------------------- the file

def _chunk(i: int, n: int) -> np.ndarray:
    """Tokens [i, i + n): a fixed pseudo-random pattern below 50257."""
    x = np.arange(i, i + n, dtype=np.uint64)
    return ((x * 2654435761 + (x >> 7) * 40503) % 50257).astype("<u2")


def make_file(path: Path) -> Path:
    from hpctrain.data.format import CHECKSUM_BLOCK_BYTES, create_token_file

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    per_block = CHECKSUM_BLOCK_BYTES // 2
    n_val = 1 << 20
    crcs = [zlib.crc32(_chunk(i, min(per_block, TOKENS - i))) for i in range(0, TOKENS, per_block)]
    tmp = path.with_suffix(".tmp")
    offsets = create_token_file(tmp, n_tokens={"train": TOKENS, "val": n_val},
                                dtype=np.dtype("<u2"), sources=[],
                                tokenizer_meta={"name": "gpt2", "vocab_size": 50257},
                                crcs={"train": np.array(crcs, np.uint32),
                                      "val": np.array([zlib.crc32(_chunk(0, n_val))], np.uint32)})
    with open(tmp, "r+b") as f:
        for i in range(0, TOKENS, per_block):
            f.seek(offsets["train"] + 2 * i)
            f.write(_chunk(i, min(per_block, TOKENS - i)).tobytes())
        f.seek(offsets["val"])
        f.write(_chunk(0, n_val).tobytes())
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    return path


def can_drop_caches() -> bool:
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


# -------------------------------------------------------------------------- workers

def worker_read(out: Path, args: list[str]) -> None:
    import torch
    from mpi4py import MPI

    from hpctrain.data.dataset import read_info
    from hpctrain.data.mpiio import MPIIODataset

    path, cache, rounds, steps = args[0], args[1], int(args[2]), int(args[3])
    only = args[4].split(",") if len(args) > 4 else None  # a subset of the methods
    comm = MPI.COMM_WORLD
    info = read_info(path)
    split = info.splits["train"]
    reader = MPIIODataset(info, comm)
    view_fh = MPI.File.Open(comm, path, MPI.MODE_RDONLY, _info(MPI, reader.hints))

    def starts(rnd, step):
        rng = np.random.default_rng([rnd, step, comm.rank])
        return rng.integers(0, split.n_tokens - BLOCK - 1, PER_RANK)

    def ours(ix):
        t = torch.from_numpy(reader.read("train", ix, BLOCK + 1, uniform=True))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def nanogpt(ix, random_access=False):
        # nanoGPT train.py get_batch: "recreate np.memmap every batch to avoid a memory leak"
        data = np.memmap(path, dtype=np.uint16, mode="r", offset=split.offset,
                         shape=(split.n_tokens,))
        if random_access:
            data._mmap.madvise(mmap.MADV_RANDOM)
        x = torch.stack([torch.from_numpy((data[i:i + BLOCK]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + BLOCK]).astype(np.int64))
                         for i in ix])
        return x, y

    def view(ix):
        order = np.argsort(ix)
        disp = (split.offset + ix[order] * 2).tolist()
        ft = MPI.BYTE.Create_hindexed([2 * (BLOCK + 1)] * len(ix), disp).Commit()
        view_fh.Set_view(0, MPI.BYTE, ft)
        buf = np.empty((len(ix), BLOCK + 1), "<u2")
        view_fh.Read_at_all(0, buf)
        ft.Free()
        rows = np.empty_like(buf)
        rows[order] = buf
        t = torch.from_numpy(rows.astype(np.int64))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    methods = {"mpiio": ours, "memmap": nanogpt,
               "memmap_random": lambda ix: nanogpt(ix, random_access=True), "view": view}
    methods = {k: v for k, v in methods.items() if only is None or k in only}
    x0 = ours(starts(0, 0))[0]  # the methods agree (and warm up)
    assert all(torch.equal(m(starts(0, 0))[0], x0) for m in methods.values())
    times = {m: [] for m in methods}
    for rnd in range(rounds):
        order = list(methods) if rnd % 2 == 0 else list(reversed(methods))
        for name in order:
            if cache == "cold":
                if comm.rank == 0:
                    can_drop_caches()
                comm.Barrier()
            comm.Barrier()
            t0 = MPI.Wtime()
            for step in range(steps):
                methods[name](starts(1 + rnd * len(methods) + order.index(name), step))
            comm.Barrier()
            times[name].append(MPI.Wtime() - t0)
    view_fh.Close()
    reader.close()
    if comm.rank == 0:
        nbytes = comm.size * steps * PER_RANK * (BLOCK + 1) * 2
        out.write_text(json.dumps({m: [nbytes / t / 1e6 for t in ts] for m, ts in times.items()}))


def _info(MPI, hints: dict):
    info = MPI.Info.Create()
    for k, v in hints.items():
        info.Set(k, v)
    return info


# --------------------------------------------------------------------------- driver

def read_bandwidth(path: Path, quick: bool) -> tuple[list, dict]:
    cold = can_drop_caches()
    with open(path, "rb") as f:  # into the page cache for the warm runs
        while f.read(64 << 20):
            pass
    rows, results = [], {}
    for cache in ("warm", "cold") if cold else ("warm",):
        rounds, steps = (3, 60 if quick else 200) if cache == "warm" else (3, 10 if quick else 30)
        for n in (1, 2, 4):
            r = run_worker(n, __file__, ["read", str(path), cache, str(rounds), str(steps)],
                           timeout=1800)
            med = {m: statistics.median(v) for m, v in r.items()}
            results[f"{cache}-{n}"] = {"ranks": n, "cache": cache, "rounds": r,
                                       "median_MBps": med, "ratio": med["mpiio"] / med["memmap"],
                                       "ratio_vs_madv_random": med["mpiio"] / med["memmap_random"]}
            rows.append([n, cache, med["mpiio"], med["memmap"], med["mpiio"] / med["memmap"],
                         med["memmap_random"], med["mpiio"] / med["memmap_random"], med["view"]])
    return rows, {"reads": results, "cold_measured": cold}


def mpi_library(python: str) -> str:
    """The MPI library ``python``'s mpi4py is built on (first words of its version)."""
    import subprocess

    p = subprocess.run([python, "-c", "from mpi4py import MPI; "
                        "print(MPI.Get_library_version().split(',')[0].split(chr(10))[0])"],
                       capture_output=True, text=True, timeout=120, env=launch_env())
    return " ".join(p.stdout.split()) if p.returncode == 0 else ""


def openmpi_setup() -> tuple[str, dict] | None:
    """(python, extra environment) that runs Open MPI workers, or None: this Python when
    its mpi4py is on Open MPI, else `.venv-openmpi`'s with Open MPI's mpirun."""
    import shutil

    if mpi_library(sys.executable).startswith("Open MPI"):
        return sys.executable, {}
    python = OPENMPI_VENV / "bin" / "python"
    mpirun = os.environ.get("HPCTRAIN_OPENMPI_MPIEXEC") or shutil.which("mpirun.openmpi")
    if python.exists() and mpirun and mpi_library(str(python)).startswith("Open MPI"):
        return str(python), {"MPIEXEC": mpirun}
    return None


def read_bandwidth_by_library(path: Path, quick: bool, reads: dict) -> tuple[list, dict]:
    """Warm MPI-IO against memmap per MPI library and MPI-IO component (see the module
    docstring): this Python's MPI from ``reads``, then Open MPI's components."""
    from hpctrain.data.mpiio import mpiio_component

    rows, results = [], {}
    here = mpi_library(sys.executable)
    for key, r in reads.items():
        if r["cache"] == "warm" and r["ranks"] > 1:
            component = mpiio_component(here)[0]
            rows.append([r["ranks"], here, component, r["median_MBps"]["mpiio"],
                         r["median_MBps"]["memmap"], r["ratio"]])
    setup = openmpi_setup()
    if setup is None:
        print("(no Open MPI: its rows need `make test-openmpi`'s .venv-openmpi)", flush=True)
        return rows, {}
    python, env = setup
    library = mpi_library(python)
    rounds, steps = 3, 60 if quick else 200
    for label, extra in OPENMPI_COMPONENTS.items():
        for n in (2, 4):
            r = run_worker(n, __file__, ["read", str(path), "warm", str(rounds), str(steps),
                                         "mpiio,memmap"], timeout=1800, python=python,
                           env={**env, **extra})
            med = {m: statistics.median(v) for m, v in r.items()}
            results[f"openmpi-{label.split()[0].lower()}-{n}"] = {
                "ranks": n, "library": library, "component": label, "rounds": r,
                "median_MBps": med, "ratio": med["mpiio"] / med["memmap"]}
            rows.append([n, library, label, med["mpiio"], med["memmap"],
                         med["mpiio"] / med["memmap"]])
    return rows, results


def data_wait(data: Path, quick: bool) -> tuple[list, dict]:
    import subprocess
    import tempfile

    steps = 100 if quick else 300
    configs = {"MPI-IO + prefetch (default)": ["--data.reader=mpiio", "--data.prefetch=true"],
               "MPI-IO, no prefetch": ["--data.reader=mpiio", "--data.prefetch=false"],
               "memory map, no prefetch": ["--data.reader=mmap", "--data.prefetch=false"]}
    shares = {k: [] for k in configs}
    per = {k: [] for k in configs}
    for _ in range(2):
        for name, extra in configs.items():
            with tempfile.TemporaryDirectory() as out:
                cmd = mpiexec(2, sys.executable, "-m", "hpctrain", "train",
                              "shakespeare-char", f"--data.path={data}",
                              f"--train.max_iters={steps}", f"--train.out_dir={out}",
                              "--train.eval_interval=0", "--train.final_eval=false",
                              "--train.sample_tokens=0", "--train.save_checkpoint=false",
                              "--train.progress=false", *extra)
                p = subprocess.run(cmd, env=launch_env(OMP_NUM_THREADS="1"), cwd=ROOT,
                                   capture_output=True, text=True, timeout=1200)
                if p.returncode:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr}")
                recs = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
                recs = [r for r in recs if "data_ms" in r][1:]  # the first window warms up
                d = statistics.fmean(r["data_ms"] for r in recs)
                s = statistics.fmean(r["step_ms"] for r in recs)
                shares[name].append(d / s)
                per[name].append((d, s))
    rows, out = [], {}
    for name in configs:
        share = statistics.median(shares[name])
        d = statistics.median(x[0] for x in per[name])
        s = statistics.median(x[1] for x in per[name])
        rows.append([name, d, s, 100 * share])
        out[name] = {"data_ms": d, "step_ms": s, "share": share, "all_shares": shares[name]}
    return rows, {"steps": steps, "ranks": 2, "configs": out}


def main(argv: list[str]) -> None:
    ap = bench_parser(__doc__, shakespeare=True)
    ap.add_argument("--keep", action="store_true", help="keep the 1 GiB test file")
    args = ap.parse_args(argv)
    quick, keep = args.quick, args.keep
    data = shakespeare_dataset(args.shakespeare)  # before the long part: fail early
    path = make_file(SCRATCH / "gpt2-like.h5")
    try:
        rows, reads = read_bandwidth(path, quick)
        lib_rows, by_library = read_bandwidth_by_library(path, quick, reads["reads"])
    finally:
        if not keep:
            path.unlink(missing_ok=True)
    print_table(f"Read bandwidth, aggregate MB/s ({BLOCK + 1}-token uint16 samples at random "
                f"offsets in a 1 GiB file, {PER_RANK} per rank per step; median of 3 rounds)",
                ["ranks", "cache", "MPI-IO (hpctrain)", "np.memmap (nanoGPT)", "MPI-IO/memmap",
                 "memmap+MADV_RANDOM", "MPI-IO/that", "MPI-IO, one call + file view"], rows)
    print_table("MPI-IO by MPI library and MPI-IO component, warm, aggregate MB/s (the same "
                "reads; memmap measured in the same run)",
                ["ranks", "MPI", "MPI-IO component", "MPI-IO (hpctrain)", "np.memmap",
                 "MPI-IO/memmap"], lib_rows)
    wait_rows, wait = data_wait(data, quick)
    print_table("Data wait while training shakespeare-char on 2 ranks (median of 2 runs)",
                ["reader", "data ms/step", "step ms", "data wait %"], wait_rows)
    worst = min(r["ratio"] for r in reads["reads"].values())
    worst_random = min(r["ratio_vs_madv_random"] for r in reads["reads"].values())
    share = wait["configs"]["MPI-IO + prefetch (default)"]["share"]
    met = worst >= 0.8 and share < 0.02
    print(f"\ntargets: MPI-IO >= 0.8x memmap: worst {fmt(worst)}x -> "
          f"{'MET' if worst >= 0.8 else 'NOT MET'}; data wait < 2%: {fmt(100 * share)}% -> "
          f"{'MET' if share < 0.02 else 'NOT MET'}"
          + ("" if reads["cold_measured"] else " (cold reads not measured: no root)"))
    print(f"(against memmap with MADV_RANDOM, not nanoGPT's method: worst {fmt(worst_random)}x)")
    write_result("io", {"quick": quick, **reads, "by_library": by_library, "data_wait": wait,
                        "targets": {"mpiio_vs_memmap": 0.8, "data_wait_share": 0.02},
                        "worst_ratio": worst, "worst_ratio_vs_madv_random": worst_random,
                        "data_wait_share": share, "met": met}, smoke=quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        worker_read(out, rest[1:])
    else:
        main(rest)
