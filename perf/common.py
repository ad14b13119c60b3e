"""Shared pieces of the benchmarks: launching workers, tables, JSON results.

Each benchmark is a driver (``python perf/bench_X.py``) that launches its workers under
``mpiexec`` at several sizes, compares against its anchor measured in the same run, prints
a table and writes ``perf/results/<name>.json``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results"
BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
CACHE = ROOT / "datasets"


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available()}


def run_worker(n: int, script: str | Path, args: list[str], *, threads: int = 1,
               timeout: float = 1200, mpi: bool = True, env: dict | None = None,
               retries: int = 0) -> dict:
    """Run ``script --worker --out FILE args`` (under ``mpiexec -n n``); return its JSON.

    ``retries``: for third-party baselines only (torch's gloo teardown aborts now and
    then with "terminate called without an active exception"); a failure is reported on
    stderr before the retry. hpctrain's own workers get none: their failures are bugs."""
    for attempt in range(retries + 1):
        try:
            return _run_worker_once(n, script, args, threads, timeout, mpi, env)
        except RuntimeError as e:
            if attempt == retries:
                raise
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            print(f"note: a baseline worker failed ({last}); running it again",
                  file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _run_worker_once(n, script, args, threads, timeout, mpi, env) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, str(script), "--worker", "--out", str(out), *args]
        if mpi:
            cmd = [MPIEXEC, "-n", str(n), *cmd]
        full_env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
        p = subprocess.run(cmd, env=full_env, text=True, capture_output=True, timeout=timeout,
                           cwd=ROOT)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({' '.join(cmd)}):\n{p.stdout}\n{p.stderr}")
        return json.loads(out.read_text())


def timed_command(cmd: list[str], *, threads: int, timeout: float = 1800) -> tuple[float, str]:
    """Wall time of a whole command (start-up included), and its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    return wall, p.stdout


def shakespeare_dataset() -> Path:
    """The tiny Shakespeare token file (char), prepared once from ../shared/data."""
    path = CACHE / "shakespeare-char.h5"
    if not path.exists():
        if not SHAKESPEARE.exists():
            raise SystemExit(f"{SHAKESPEARE} is missing: the benchmarks need tiny Shakespeare")
        from hpctrain.data.prepare import prepare

        prepare([SHAKESPEARE], path, show_progress=False)
    return path


def init_gloo(comm) -> None:
    """torch.distributed (gloo) on the ranks of an MPI job: rank 0 picks a free port."""
    import socket

    import torch.distributed as dist

    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size)


class TorchDDP:
    """torch DDP (gloo) on this MPI job's ranks with the same model, data and sampler as
    hpctrain; ``make_optimizer(model, cfg)`` picks the optimizer. ``step(i)`` trains
    step ``i`` (the global batch of step i, this rank's rows); ``close()`` ends gloo."""

    def __init__(self, args: list[str], make_optimizer):
        import torch
        from mpi4py import MPI
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hpctrain.config import load_config
        from hpctrain.data.dataset import TokenDataset
        from hpctrain.data.sampler import make_sampler
        from hpctrain.model.gpt import GPT, GPTConfig

        self.comm = MPI.COMM_WORLD
        init_gloo(self.comm)
        self.cfg = cfg = load_config("shakespeare-char", args)
        m, t = cfg.model, cfg.train
        self.ds = TokenDataset(cfg.data.path)
        torch.manual_seed(t.seed)
        self.model = GPT(GPTConfig(vocab_size=self.ds.vocab_size, block_size=m.block_size,
                                   n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd))
        self.ddp = DDP(self.model, gradient_as_bucket_view=True)  # DDP's fastest setting
        self.opt = make_optimizer(self.model, cfg)
        self.sampler = make_sampler(cfg.data.sampler, self.ds.splits["train"].n_tokens,
                                    m.block_size, t.batch_size, t.seed)

    def step(self, step: int) -> None:
        import torch

        starts = self.sampler.local_starts(step, self.comm.rank, self.comm.size)
        tokens = torch.from_numpy(self.ds.read("train", starts, self.cfg.model.block_size + 1))
        loss = self.ddp(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def torch_ddp_step_times(args: list[str], make_optimizer) -> list[float]:
    """Train a config's ``train.max_iters`` steps with ``TorchDDP``; the step times (s)."""
    import time

    runner = TorchDDP(args, make_optimizer)
    times = []
    for step in range(runner.cfg.train.max_iters):
        t0 = time.perf_counter()
        runner.step(step)
        times.append(time.perf_counter() - t0)
    runner.close()
    return times


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "git_sha": git_sha(), "machine": machine(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {path.relative_to(ROOT)}")
    return path


def worker_args(argv: list[str]) -> tuple[bool, Path | None, list[str]]:
    """Split ``--worker --out FILE`` from the rest of the arguments."""
    if "--worker" not in argv:
        return False, None, argv
    rest = [a for a in argv if a != "--worker"]
    i = rest.index("--out")
    return True, Path(rest[i + 1]), rest[:i] + rest[i + 2:]
