"""Preparing corpora with GPT-2's BPE: ``hpctrain prepare`` on a Parquet and a JSON-lines
corpus at 1 and 2 ranks, against a process-pool tokenizer built the way nanoGPT's
``data/fineweb/fineweb.py`` tokenizes FineWeb, with as many processes.

The corpus is this Python's standard library sources (``make run``'s default data),
cut into documents of about ``DOC_BYTES`` at line ends (a web page's size), taken again
in order until the corpus has ``--mb`` MB (GPT-2's BPE keeps no cache between
documents: a repeated document costs what a new one does), written once as Parquet (row
groups of ``GROUP_ROWS`` documents) and as JSON lines.

  hpctrain   ``hpctrain prepare --tokenizer gpt2`` under ``mpiexec -n N`` (its CLI in
             the worker: plan, tokenize, HDF5 write through MPI-IO, read-back check);
             timed with Barrier + Wtime around the command
  pool       the parent reads the documents (pyarrow record batches, or ``json.loads``
             per line), ``multiprocessing.Pool(N).imap(.., chunksize=16)`` encodes each
             with tiktoken's ``encode_ordinary`` after the end-of-text token and
             returns a ``uint16`` array, the parent joins them and writes the array
             (``tofile``); timed from loading the encoding to the written file

Both run on the same cores: the first N of the machine (``sched_setaffinity`` in every
rank, and in the pool's parent before it forks), so the pool's parent, which reads and
joins while its N workers encode, shares them as it would on a node given N cores.
Both give the same tokens (checked: the pool's array equals the prepared file's train +
validation tokens). Rounds interleave the methods (the order alternates); medians with
[min, max] of the rounds; ratio = hpctrain tokens/s / pool tokens/s at equal process
counts. Memory: peak RSS (``ru_maxrss``) of each rank, and of the pool's parent and its
largest worker, with the growth over the process's RSS before the work; CPU seconds of
every process in the timed part (tokens per CPU second: the per-core efficiency).

Goal: ratio >= 1.0 in every configuration.

    python perf/bench_prepare.py [--quick] [--mb 40]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (ROOT, bench_parser, fmt, fmt_spread, print_table,  # noqa: E402
                         run_worker, spread, worker_args, write_result)
from hpctrain.sizes import MiB  # noqa: E402

DOC_BYTES = 4000
GROUP_ROWS = 256
SCRATCH = Path(os.environ.get("HPCTRAIN_BENCH_DIR", "/tmp/hpctrain-bench-prepare"))
R50K_SHA1 = "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"  # tiktoken's cache name of r50k_base
GOAL = 1.0


# ------------------------------------------------------------------------ the corpus

def documents(total_bytes: int) -> list[str]:
    """The standard library's sources in documents of about DOC_BYTES, cut at line ends,
    repeated until they hold ``total_bytes``."""
    from hpctrain.data.corpus import stdlib_files

    docs = []
    for path in stdlib_files(total_bytes):
        doc = []
        for line in path.read_text().splitlines(keepends=True):
            doc.append(line)
            if sum(map(len, doc)) >= DOC_BYTES:
                docs.append("".join(doc))
                doc = []
        if doc:
            docs.append("".join(doc))
    size, out = 0, []
    while size < total_bytes:
        for doc in docs:
            out.append(doc)
            size += len(doc)
            if size >= total_bytes:
                break
    return out


def write_corpora(docs: list[str], folder: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = {"parquet": folder / "corpus.parquet", "jsonl": folder / "corpus.jsonl"}
    pq.write_table(pa.table({"text": docs}), paths["parquet"], row_group_size=GROUP_ROWS)
    with open(paths["jsonl"], "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return paths


def gpt2_cache() -> str:
    """tiktoken's cache holding GPT-2's BPE (r50k_base): $TIKTOKEN_CACHE_DIR, else the
    one ``make datasets/stdlib-gpt2.h5`` fills in the virtual environment."""
    for folder in (os.environ.get("TIKTOKEN_CACHE_DIR"), str(ROOT / ".venv/share/tiktoken")):
        if folder and Path(folder, R50K_SHA1).is_file():
            return folder
    raise SystemExit("GPT-2's BPE file is not in tiktoken's cache: run `make "
                     "datasets/stdlib-gpt2.h5` (it fetches it into .venv/share/tiktoken) or "
                     "set TIKTOKEN_CACHE_DIR to a cache holding r50k_base")


# --------------------------------------------------------------------------- workers

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pin(n: int) -> None:
    """This process (and what it forks) on the machine's first ``n`` cores."""
    os.sched_setaffinity(0, set(range(min(n, os.cpu_count() or n))))


def _cpu_seconds(who=resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def worker_ours(out: Path, args: list[str]) -> None:
    from mpi4py import MPI

    import hpctrain.data.prepare  # noqa: F401 - imported before the clock, as the pool's are
    from hpctrain.cli import main

    source, target = args
    comm = MPI.COMM_WORLD
    _pin(comm.size)
    before = _rss()
    comm.Barrier()
    cpu0, t0 = _cpu_seconds(), MPI.Wtime()
    rc = main(["prepare", "--input", source, "--tokenizer", "gpt2", "--output", target,
               "--overwrite", "--val-fraction", "0.01"])
    comm.Barrier()
    seconds = MPI.Wtime() - t0
    cpu = comm.reduce(_cpu_seconds() - cpu0, root=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss = comm.gather((before, peak), root=0)
    if comm.rank == 0:
        if rc != 0:
            raise SystemExit(f"hpctrain prepare exited {rc}")
        out.write_text(json.dumps({"seconds": seconds, "cpu_s": cpu, "rss": rss}))


_ENCODING = None  # set in the parent before the pool forks: every worker inherits it


def _encode_document(text: str) -> np.ndarray:
    ids = [_ENCODING.eot_token]
    ids.extend(_ENCODING.encode_ordinary(text))
    return np.array(ids, dtype=np.uint16)  # GPT-2's 50,257 ids fit 16 bits


def _read_documents(kind: str, path: str):
    if kind == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
            yield from batch.column(0).to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def worker_pool(out: Path, args: list[str]) -> None:
    import multiprocessing

    import tiktoken

    global _ENCODING
    kind, source, target, procs = args[0], args[1], args[2], int(args[3])
    _pin(procs)
    before = _rss()
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    _ENCODING = tiktoken.get_encoding("r50k_base")  # GPT-2's vocabulary, as hpctrain's gpt2
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        parts = list(pool.imap(_encode_document, _read_documents(kind, source), chunksize=16))
    tokens = np.concatenate(parts)
    tokens.tofile(target)
    seconds = time.perf_counter() - t0
    cpu = _cpu_seconds() - cpu0 + _cpu_seconds(resource.RUSAGE_CHILDREN)
    out.write_text(json.dumps({
        "seconds": seconds, "cpu_s": cpu, "tokens": int(tokens.size), "rss_before": before,
        "parent_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "worker_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))


# --------------------------------------------------------------------------- driver

def _prepared_tokens(path: Path) -> np.ndarray:
    import h5py

    with h5py.File(path, "r") as f:
        return np.concatenate([f["train"][:], f["val"][:]])


def run_round(paths: dict, procs: list[int], rnd: int, runs: dict, cache: str) -> None:
    env = {"TIKTOKEN_CACHE_DIR": cache}
    for kind, source in paths.items():
        for n in procs:
            key = f"{kind}-{n}"
            ours_out, pool_out = SCRATCH / f"{key}.h5", SCRATCH / f"{key}.bin"
            methods = [("hpctrain", lambda: run_worker(n, __file__, [
                          "ours", str(source), str(ours_out)], env=env, timeout=1800)),
                       ("pool", lambda: run_worker(1, __file__, [
                          "pool", kind, str(source), str(pool_out), str(n)], mpi=False,
                          env=env, timeout=1800))]
            for name, fn in methods if rnd % 2 == 0 else reversed(methods):
                runs.setdefault(key, {}).setdefault(name, []).append(fn())
            if rnd == 0:  # the same tokens both ways
                ours, theirs = _prepared_tokens(ours_out), np.fromfile(pool_out, np.uint16)
                if not np.array_equal(ours, theirs):
                    raise SystemExit(f"{key}: hpctrain's tokens differ from the pool's")


def summarize(runs: dict, tokens: dict) -> tuple[list, dict]:
    rows, out = [], {}
    for key, by in runs.items():
        kind, n = key.rsplit("-", 1)
        n_tok = tokens[kind]
        ours = [n_tok / r["seconds"] for r in by["hpctrain"]]
        pool = [n_tok / r["seconds"] for r in by["pool"]]
        ratio = statistics.median(ours) / statistics.median(pool)
        per_cpu = [statistics.median(n_tok / r["cpu_s"] for r in by[m])
                   for m in ("hpctrain", "pool")]
        rank_peak = max(p for r in by["hpctrain"] for _, p in r["rss"])
        rank_growth = max(p - b for r in by["hpctrain"] for b, p in r["rss"])
        parent = max(r["parent_peak"] for r in by["pool"])
        worker = max(r["worker_peak"] for r in by["pool"])
        out[key] = {"format": kind, "processes": int(n), "tokens": n_tok,
                    "hpctrain_tokens_per_s": spread(ours), "pool_tokens_per_s": spread(pool),
                    "ratio": ratio, "hpctrain_tokens_per_cpu_s": per_cpu[0],
                    "pool_tokens_per_cpu_s": per_cpu[1], "hpctrain_peak_rss_per_rank": rank_peak,
                    "hpctrain_rss_growth_per_rank": rank_growth,
                    "pool_parent_peak_rss": parent, "pool_worker_peak_rss": worker,
                    "rounds": by}
        rows.append([kind, n, fmt_spread(ours, 1e-6), fmt_spread(pool, 1e-6), fmt(ratio),
                     fmt(per_cpu[0] / per_cpu[1]), fmt(rank_peak / MiB),
                     fmt(rank_growth / MiB), fmt(parent / MiB), fmt(worker / MiB)])
    return rows, out


def main(argv: list[str]) -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--mb", type=float, default=40.0,
                    help="corpus size in MB of text (default 40)")
    args = ap.parse_args(argv)
    cache = gpt2_cache()
    rounds, procs = (1, [1, 2]) if args.quick else (5, [1, 2])
    docs = documents(int(args.mb * 1e6))
    paths = write_corpora(docs, SCRATCH)
    text_bytes = sum(len(d.encode()) for d in docs)
    print(f"corpus: {len(docs):,} documents, {text_bytes / 1e6:.1f} MB of text; "
          f"{', '.join(f'{k} {p.stat().st_size / 1e6:.1f} MB' for k, p in paths.items())}",
          flush=True)
    runs: dict = {}
    for rnd in range(rounds):
        run_round(paths, procs, rnd, runs, cache)
        print(f"round {rnd + 1} of {rounds} done", flush=True)
    tokens = {kind: int(_prepared_tokens(SCRATCH / f"{kind}-1.h5").size) for kind in paths}
    rows, results = summarize(runs, tokens)
    print_table(f"prepare with GPT-2's BPE, million tokens/s, median [min, max] of {rounds} "
                "rounds; peak RSS in MiB",
                ["format", "processes", "hpctrain prepare", "process pool (nanoGPT)",
                 "ratio", "per CPU s", "peak RSS/rank", "growth/rank", "pool parent",
                 "pool worker"], rows)
    worst = min(r["ratio"] for r in results.values())
    met = worst >= GOAL
    print(f"\ngoal: hpctrain >= {GOAL}x the process pool at equal process counts: worst "
          f"{fmt(worst)}x -> {'MET' if met else 'NOT MET'}")
    write_result("prepare", {"quick": args.quick, "documents": len(docs),
                             "text_bytes": text_bytes, "doc_bytes": DOC_BYTES,
                             "group_rows": GROUP_ROWS, "rounds_run": rounds,
                             "configs": results, "goal": GOAL, "worst_ratio": worst,
                             "met": met}, smoke=args.quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        (worker_ours if rest[0] == "ours" else worker_pool)(out, rest[1:])
    else:
        main(rest)
