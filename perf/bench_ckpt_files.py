"""Files and metadata operations per sharded checkpoint: a file per rank
(``--train.ckpt_files=rank``) against a file per node (``node``), 4 ranks, the nodes
simulated by ``HPCTRAIN_TEST_RANKS_PER_NODE`` (2 nodes of 2 ranks, 1 node of 4).

Counted, not timed: every rank runs under ``strace -f -y``, and a metadata operation is
a system call of METADATA_CALLS that names a path under the checkpoint root (``-y``
shows a descriptor's path): opens and creates, stats, mkdir, rename, unlink, rmdir,
fsync, fallocate, chmod, directory reads and closes, each of which a parallel file
system's metadata servers answer (Lustre, GPFS; a close and an fsync are metadata
traffic there too). The calls that name a shard file (``rank_*.h5``, ``node_*.h5``,
and the space reservation made before each) are split from the rest (the step directory, the
manifest, ``latest``, pruning the checkpoint before), so the count at 10,000 ranks
follows as measured calls per shard file x files + the rest: 10,000 files with
``rank``, 10,000 / ranks per node with ``node`` (4 on Polaris, 8 on Frontier, 12 on
Aurora). That assumes each file costs what it costs here (true of these calls: each
file is opened, reserved, written, fsynced and closed once); it says nothing about
the servers' time per call. Each mode saves SAVES checkpoints of a ZeRO-1 model (keep
1, as a run with ``--train.ckpt_keep=1``), the counts are divided by SAVES; the save
time (without strace) is reported beside them, median [min, max] of SAVES.

      python perf/bench_ckpt_files.py [--quick]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (ROOT, bench_parser, fmt, fmt_spread, launch_env,  # noqa: E402
                         mpiexec, print_table, worker_args, write_result)
from perf.results_format import md_table  # noqa: E402

MODEL = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
RANKS, SAVES, AT_SCALE = 4, 3, 10_000
PER_NODE_AT_SCALE = {"Polaris": 4, "Frontier": 8, "Aurora": 12}
MODES = [("rank", 1), ("node", 2), ("node", 4)]
METADATA_CALLS = ("open", "openat", "creat", "stat", "lstat", "fstat", "newfstatat", "statx",
                  "access", "faccessat", "faccessat2", "mkdir", "mkdirat", "rename",
                  "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "fsync",
                  "fdatasync", "fallocate", "chmod", "fchmod", "fchmodat", "getdents64",
                  "close")
SHARD_FILE = re.compile(r"(rank|node)_\d+\.h5|\.hpctrain-room\.")


def worker(out: Path, root: str, files: str, saves: int) -> None:
    import time

    import torch
    from mpi4py import MPI

    from hpctrain.checkpoint.distributed import save_sharded
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.comm.world import World
    from hpctrain.config import OptimConfig, build_config
    from hpctrain.model.gpt import GPT, GPTConfig
    from hpctrain.parallel.zero import Zero

    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = GPT(cfg)
    world = World.create(comm, device="cpu")
    grid = ProcessGrid.create(world)
    zero = Zero(model, world, OptimConfig(), level=1)
    config = build_config({"train": {"ckpt_files": files}}).to_dict()
    times = []
    for step in range(1, saves + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        save_sharded(Path(root), step, zero, grid, run={"config": config,
                                                        "model": cfg.shape()}, keep=1)
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    if comm.rank == 0:
        latest = Path(root) / (Path(root) / "latest").read_text().strip()
        out.write_text(json.dumps({"save_s": times, "nodes": world.n_nodes,
                                   "params": sum(p.numel() for p in model.parameters()),
                                   "files": sorted(p.name for p in latest.iterdir())}))
    world.close()


def run_mode(files: str, per_node: int, saves: int, traced: bool) -> dict:
    """One launch of 4 ranks saving ``saves`` checkpoints; with ``traced``, the metadata
    calls on the checkpoint root, per checkpoint, split into shard files and the rest."""
    with tempfile.TemporaryDirectory() as tmp:
        root, out, log = Path(tmp) / "checkpoints", Path(tmp) / "out.json", Path(tmp) / "log"
        cmd = mpiexec(RANKS, sys.executable, __file__, "--worker", "--out", str(out),
                      str(root), files, str(saves))
        if traced:
            cmd = ["strace", "-f", "-y", "-qq", "-e", "trace=" + ",".join(METADATA_CALLS),
                   "-o", str(log), *cmd]
        env = launch_env(OMP_NUM_THREADS="1", HPCTRAIN_TEST_RANKS_PER_NODE=str(per_node))
        subprocess.run(cmd, env=env, check=True, timeout=900, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
        if traced:
            result.update(count_calls(log.read_text(), str(root), saves))
        shutil.rmtree(root, ignore_errors=True)
    return result


def count_calls(log: str, root: str, saves: int) -> dict:
    """Per checkpoint: the metadata calls naming a path under ``root``, by call, those
    on shard files apart."""
    by_call, shard, other = Counter(), 0, 0
    for line in log.splitlines():
        m = re.match(r"\d+\s+(\w+)\(", line)
        if not m or m.group(1) not in METADATA_CALLS or root not in line:
            continue
        by_call[m.group(1)] += 1
        if SHARD_FILE.search(line.split(root, 1)[1]):
            shard += 1
        else:
            other += 1
    return {"calls": {k: v / saves for k, v in sorted(by_call.items())},
            "shard_calls": shard / saves, "other_calls": other / saves}


def at_scale(r: dict, files: str, per_node: int) -> int:
    """Metadata calls per checkpoint at AT_SCALE ranks, ``per_node`` ranks per node."""
    measured_files = sum(1 for f in r["files"] if SHARD_FILE.fullmatch(f))
    per_file = r["shard_calls"] / measured_files
    n = AT_SCALE if files == "rank" else -(-AT_SCALE // per_node)
    return round(per_file * n + r["other_calls"])


COLUMNS = ["ckpt_files", "files", "calls", "on shard files", "other", "vs rank", "save s",
           *[f"at {AT_SCALE:,}: {s}" for s in PER_NODE_AT_SCALE]]


def _rows(records: dict) -> list[list]:
    return [[name, len(r["files"]), fmt(r["shard_calls"] + r["other_calls"]),
             fmt(r["shard_calls"]), fmt(r["other_calls"]), fmt(r["calls_vs_rank"]),
             fmt_spread(r["timed_save_s"]), *[f"{v:,}" for v in r["at_scale"].values()]]
            for name, r in records.items()]


def render_ckpt_files(d: dict) -> list[str]:
    """perf/RESULTS.md's section (``make_results.py``)."""
    rec = d["records"]
    return [f"Per checkpoint, {d['ranks']} ranks ({fmt(rec['rank']['params'] / 1e6)}M "
            f"parameters, ZeRO-1), nodes simulated; files in the step directory (the "
            "manifest included), metadata calls naming the checkpoint's paths (mean of "
            f"{d['saves']} saves; `vs rank`: against a file per rank), save seconds "
            f"(median [min, max] of {d['saves']}), and the calls implied at "
            f"{d['at_scale_ranks']:,} ranks with each system's ranks per node "
            f"({', '.join(f'{k} {v}' for k, v in d['per_node_at_scale'].items())}).", "",
            *md_table(COLUMNS, _rows(rec))]


def main(argv: list[str]) -> None:
    args = bench_parser(__doc__).parse_args(argv)
    saves = 2 if args.quick else SAVES
    records = {}
    for files, per_node in MODES:
        name = f"{files}" + (f", {per_node} ranks/node" if files == "node" else "")
        r = run_mode(files, per_node, saves, traced=True)
        r["timed_save_s"] = run_mode(files, per_node, saves, traced=False)["save_s"]
        r["at_scale"] = {s: at_scale(r, files, n if files == "node" else 1)
                         for s, n in PER_NODE_AT_SCALE.items()}
        records[name] = r
    base = records["rank"]["shard_calls"] + records["rank"]["other_calls"]
    for r in records.values():
        r["calls_vs_rank"] = (r["shard_calls"] + r["other_calls"]) / base
    print_table(f"Per checkpoint, {RANKS} ranks ({records['rank']['params'] / 1e6:.1f}M "
                f"parameters, ZeRO-1); metadata calls naming the checkpoint's paths; "
                f"implied at {AT_SCALE:,} ranks with each system's ranks per node",
                COLUMNS, _rows(records))
    write_result("ckpt_files", {"quick": args.quick, "saves": saves, "ranks": RANKS,
                                "model": MODEL, "at_scale_ranks": AT_SCALE,
                                "per_node_at_scale": PER_NODE_AT_SCALE,
                                "records": records}, smoke=args.quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        worker(out, rest[0], rest[1], int(rest[2]))
    else:
        main(rest)
