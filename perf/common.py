"""Shared pieces of the benchmarks: launching workers, tables, JSON results.

Each benchmark is a driver (``python perf/bench_X.py``) that launches its workers under
``mpiexec`` at several sizes, compares against its anchor measured in the same run, prints
a table and writes ``perf/results/<name>.json``. Every result records the commit and
whether the tree was clean (``write_result``); repeated measurements are stored raw and
summarised as median [min, max] (``spread``), printed with one formatter (``fmt``) that
``perf/make_results.py`` uses too, so a figure reads the same on the console and in
``perf/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpctrain.comm.local_mpiexec import find_launcher
from hpctrain.scaling.records import cpu_model
from hpctrain.sizes import MiB

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results"
CACHE = ROOT / "datasets"
SHAKESPEARE_ENV = "HPCTRAIN_SHAKESPEARE"
SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                   "tinyshakespeare/input.txt")
RESULTS_DIR_PREFIX = "perf/results/"  # results being written do not make a tree dirty
_STARTED = time.monotonic()  # the driver's start: write_result records the run's duration


def _git(*args: str) -> str | None:
    try:
        p = subprocess.run(["git", *args], cwd=ROOT, text=True, capture_output=True,
                           timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def git_sha() -> str:
    out = _git("rev-parse", "--short", "HEAD")
    return out.strip() if out and out.strip() else "unknown"


def dirty_paths(porcelain: str, ignore: str = RESULTS_DIR_PREFIX) -> list[str]:
    """Paths that ``git status --porcelain`` lists (changed, staged or untracked), except
    those under ``ignore``. A rename counts both of its names."""
    paths = []
    for line in porcelain.splitlines():
        if len(line) < 4:
            continue
        for path in line[3:].split(" -> "):
            path = path.strip().strip('"')
            if path and not path.startswith(ignore):
                paths.append(path)
    return paths


def git_state() -> dict:
    """The commit and whether the tree matches it (None: not a git checkout). A tree
    copied to another machine (whose .git, if any, is not the copy's) is named by
    ``HPCTRAIN_COMMIT`` and ``HPCTRAIN_TREE_CLEAN=1``, set by whoever copied it."""
    if os.environ.get("HPCTRAIN_COMMIT"):
        return {"git_sha": os.environ["HPCTRAIN_COMMIT"],
                "tree_clean": os.environ.get("HPCTRAIN_TREE_CLEAN") == "1",
                "copied_tree": True}
    status = _git("status", "--porcelain")
    if status is None:
        return {"git_sha": git_sha(), "tree_clean": None}
    dirty = dirty_paths(status)
    state = {"git_sha": git_sha(), "tree_clean": not dirty}
    if dirty:
        state["dirty_paths"] = dirty[:50]
    return state


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}


# ------------------------------------------------------------------ command line, data

def bench_parser(doc: str | None, *, shakespeare: bool = False) -> argparse.ArgumentParser:
    """The options every benchmark shares: ``--quick`` (a smoke test of a minute or two,
    not a result to quote) and, for those that train on it, ``--shakespeare PATH``."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="few repetitions and configurations: checks that it runs")
    if shakespeare:
        ap.add_argument("--shakespeare", metavar="PATH", default=None,
                        help=f"tiny Shakespeare text (default: ${SHAKESPEARE_ENV}); "
                             f"karpathy/char-rnn's input.txt, {SHAKESPEARE_URL}")
    return ap


def shakespeare_text(path: str | Path | None) -> Path:
    """The tiny Shakespeare text file: ``path``, else $HPCTRAIN_SHAKESPEARE."""
    given = path if path else os.environ.get(SHAKESPEARE_ENV)
    how = (f"download karpathy/char-rnn's tiny Shakespeare ({SHAKESPEARE_URL}) and pass "
           f"--shakespeare PATH or set {SHAKESPEARE_ENV}=PATH")
    if not given:
        raise SystemExit(f"this benchmark needs tiny Shakespeare: {how}")
    text = Path(given).expanduser().resolve()
    if not text.is_file():
        raise SystemExit(f"{text} (tiny Shakespeare) does not exist: {how}")
    return text


def mpiexec(n: int, *cmd: str) -> list[str]:
    """``cmd`` on ``n`` ranks under this machine's launcher (``MPIEXEC``, else the
    venv's mpiexec; ``hpctrain/comm/local_mpiexec.py`` adds what its MPI needs)."""
    return find_launcher().command(n, *cmd)


def launch_env(**extra: str) -> dict[str, str]:
    """This process's environment, what the launcher needs (Open MPI as root), ``extra``."""
    return find_launcher().environ(**extra)


def run_worker(n: int, script: str | Path, args: list[str], *, threads: int = 1,
               timeout: float = 1200, mpi: bool = True, env: dict | None = None,
               retries: int = 0, python: str | None = None) -> dict:
    """Run ``script --worker --out FILE args`` (under ``mpiexec -n n``); return its JSON.

    ``python``: another interpreter (another virtual environment, with mpi4py built
    against another MPI); ``env`` may name that MPI's launcher in ``MPIEXEC``.

    ``retries``: for third-party baselines only (torch's gloo teardown aborts now and
    then with "terminate called without an active exception"); a failure is reported on
    stderr before the retry. hpctrain's own workers get none: their failures are bugs."""
    for attempt in range(retries + 1):
        try:
            return _run_worker_once(n, script, args, threads, timeout, mpi, env, python)
        except RuntimeError as e:
            if attempt == retries:
                raise
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            print(f"note: a baseline worker failed ({last}); running it again",
                  file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def run(cmd: list[str], timeout: float, *, full_env: dict | None = None,
        **env: str) -> tuple[int, str]:
    """``cmd``'s exit status and its output (stdout and stderr), 124 on a timeout, when
    its process group (the launcher and the ranks it started) is ended: SIGTERM, then
    SIGKILL after 10 s, so no rank lives on holding a core or a GPU. ``env``: variables to
    set beside the launcher's; ``full_env``: the whole environment instead."""
    if timeout <= 0:
        return 124, "(no time left for this run)"
    p = subprocess.Popen(cmd, cwd=ROOT, env=full_env or launch_env(**env), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        out = ""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not _signal_group(p.pid, sig):
                break
            try:
                out = p.communicate(timeout=10)[0] or ""
                _signal_group(p.pid, signal.SIGKILL)  # a rank that closed its output
                break
            except subprocess.TimeoutExpired:
                continue
        return 124, out + f"\n(timed out after {timeout:.0f} s)"


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when none of it is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _run_worker_once(n, script, args, threads, timeout, mpi, env, python) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [python or sys.executable, str(script), "--worker", "--out", str(out), *args]
        launcher = find_launcher({**os.environ, **(env or {})}, python=python)
        if mpi:
            cmd = launcher.command(n, *cmd)
        full_env = launcher.environ(OMP_NUM_THREADS=str(threads), **(env or {}))
        rc, text = run(cmd, timeout, full_env=full_env)
        if rc != 0 or not out.exists():
            raise RuntimeError(f"worker failed (exit {rc}; {' '.join(cmd)}):\n{text}")
        return json.loads(out.read_text())


def largest_that_fits(label: str, widths: list[int], fits) -> dict | None:
    """Binary search for the widest model that ``fits(width) -> (ok, record)`` accepts
    (``widths`` ascending; one run per probe); its record with ``width``, or None. Each
    probe prints a line; one that fits the widest says the search ended too early."""
    lo, hi, best = 0, len(widths) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        ok, r = fits(widths[mid])
        print(f"  {label}, width {widths[mid]}: {r['params'] / 1e6:.1f}M params, peak RSS "
              f"growth {r['peak_rss_growth'] / MiB:.0f} MiB -> "
              f"{'fits' if ok else 'too big'}", flush=True)
        if ok:
            best, lo = {"width": widths[mid], **r}, mid + 1
        else:
            hi = mid - 1
    if best is not None and best["width"] == widths[-1]:
        print(f"  {label} fits the widest model searched: search wider widths", flush=True)
    return best


def timed_command(cmd: list[str], *, threads: int, timeout: float = 1800) -> tuple[float, str]:
    """Wall time of a whole command (start-up included), and its stdout."""
    env = launch_env(OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    return wall, p.stdout


def shakespeare_dataset(text: str | Path | None = None) -> Path:
    """The tiny Shakespeare token file (char) in datasets/, prepared once from the text
    (``shakespeare_text``); the text is needed only while that file does not exist."""
    path = CACHE / "shakespeare-char.h5"
    if path.exists():
        print(f"tiny Shakespeare: {path.relative_to(ROOT)}, prepared earlier (delete it to "
              "prepare it again from the text)", flush=True)
        return path
    from hpctrain.data.prepare import prepare

    prepare([shakespeare_text(text)], path, show_progress=False)
    return path


def init_gloo(comm) -> None:
    """torch.distributed (gloo) on the ranks of an MPI job, started as
    ``--comm.transport=xccl`` starts it (``device_collectives.start``)."""
    from hpctrain.comm import device_collectives
    from hpctrain.comm.device import Accelerator

    device_collectives.start(comm, Accelerator(), timeout=300.0)


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
        from hpctrain.model.gpt import GPT

        self.comm = MPI.COMM_WORLD
        init_gloo(self.comm)
        self.cfg = cfg = load_config("shakespeare-char", args)
        m, t = cfg.model, cfg.train
        self.ds = TokenDataset(cfg.data.path)
        torch.manual_seed(t.seed)
        self.model = GPT(m.to_gpt(self.ds.vocab_size))
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
        from hpctrain.comm import device_collectives

        device_collectives.stop()


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


# ---------------------------------------------------------------- figures and tables

def spread(values) -> dict:
    """Median, mean, min and max of repeated measurements (``n``: how many)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "mean": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "min": min(values), "max": max(values), "n": len(values)}


def fmt(v, scale: float = 1.0) -> str:
    """One rounding for the console, the JSON's readers and RESULTS.md: 3 decimals below
    100, whole numbers with thousands separators above; ``scale`` multiplies first."""
    if v is None:
        return "n/a"
    if isinstance(v, bool) or isinstance(v, int) and scale == 1.0:
        return str(v)
    if isinstance(v, (int, float)):
        v = float(v) * scale
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def fmt_spread(values, scale: float = 1.0, center: str = "median") -> str:
    """``median [min, max]`` (or ``mean [min, max]``) of repeated measurements; just the
    value when there is one."""
    s = spread(values)
    if s["n"] <= 1:
        return fmt(s[center], scale)
    return f"{fmt(s[center], scale)} [{fmt(s['min'], scale)}, {fmt(s['max'], scale)}]"


def table_lines(columns: list[str], rows: list[list], markdown: bool = False) -> list[str]:
    cells = [[v if isinstance(v, str) else fmt(v) for v in row] for row in rows]
    if markdown:
        return ["| " + " | ".join(columns) + " |",
                "|" + "|".join("---" for _ in columns) + "|",
                *("| " + " | ".join(r) + " |" for r in cells)]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    return ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(),
            "  ".join("-" * w for w in widths),
            *("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells)]


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    print(f"\n{title}")
    print("\n".join(table_lines(columns, rows)), flush=True)


def write_result(name: str, payload: dict, *, smoke: bool = False) -> Path:
    """Write ``perf/results/<name>.json`` with the commit, whether the tree was clean
    (results in perf/results/ aside), the machine and the time; say so if it was not.
    A smoke test (``--quick``, fewer steps) goes to perf/results/quick/ (not committed),
    so it never replaces a result that RESULTS.md is made from."""
    folder = RESULTS / "quick" if smoke else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    state = git_state()
    t = os.times()  # the workers' CPU time counts once mpiexec has reaped them
    payload = {"benchmark": name, **state, "machine": machine(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "duration_s": time.monotonic() - _STARTED,
               "cpu_s": t.user + t.system + t.children_user + t.children_system, **payload}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\nwrote {path.relative_to(ROOT)} (commit {state['git_sha']}, "
          f"{describe_tree(state.get('tree_clean'))}; {payload['duration_s']:.0f} s, "
          f"{payload['cpu_s']:.0f} CPU s)")
    if state.get("tree_clean") is False:
        shown = ", ".join(state["dirty_paths"][:5])
        more = len(state["dirty_paths"]) - 5
        print(f"WARNING: run from a dirty tree ({shown}{f' and {more} more' if more > 0 else ''}"
              f"): these numbers are not those of commit {state['git_sha']}; commit and "
              "run again before quoting them", flush=True)
    return path


def scratch_dir(tag: str, comm=None) -> str:
    """A new empty directory under /tmp for one trainer's out_dir (collective over
    ``comm``: rank 0 makes it, every rank gets its name). A trainer refuses an out_dir
    that holds another run's outputs, and a benchmark must not read an earlier run's."""
    path = tempfile.mkdtemp(prefix=f"hpctrain-bench-{tag}-") \
        if comm is None or comm.rank == 0 else None
    return path if comm is None else comm.bcast(path, root=0)


def describe_tree(clean: bool | None) -> str:
    return {True: "clean tree", False: "DIRTY tree"}.get(clean, "tree state unknown")


def worker_args(argv: list[str]) -> tuple[bool, Path | None, list[str]]:
    """Split ``--worker --out FILE`` from the rest of the arguments. In a worker, an
    uncaught exception aborts the whole MPI job: the other ranks would otherwise wait
    for it in their next collective until run_worker's timeout."""
    if "--worker" not in argv:
        return False, None, argv
    sys.excepthook = _abort_on_exception
    rest = [a for a in argv if a != "--worker"]
    i = rest.index("--out")
    return True, Path(rest[i + 1]), rest[:i] + rest[i + 2:]


def _abort_on_exception(kind, value, tb) -> None:
    sys.__excepthook__(kind, value, tb)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            and mpi.COMM_WORLD.size > 1:
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(1)
