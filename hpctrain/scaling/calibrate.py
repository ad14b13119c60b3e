"""``hpctrain scale calibrate``: measure this machine for the performance model.

Four measurements, none of them a training run of the study: compute per model shape and
dtype (forward + backward at two batch sizes, fitted as layers x overhead + FLOPs / rate),
the optimizer (fused AdamW, fitted as overhead + params x cost), collectives at each
group size (``mpiexec`` of ``calib_worker``, plus how much slower ranks compute when they
share cores), and the peak matrix-product rate for MFU. The result is a JSON file that
names its base system (``local``); studies use it with ``calibration = FILE``.
Each measurement and its fit: docs/design/scaling-model.md ("``scale calibrate``").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpctrain.config import OptimConfig
from hpctrain.errors import UserError
from hpctrain.scaling.models import ModelShape
from hpctrain.scaling.records import environment, git_state, now


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up: allocator, kernels, thread pool
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_compute(shape: ModelShape, dtype: str, rows=(2, 8), reps: int = 7) -> dict:
    """Rate and per-layer overhead of one shape's forward + backward (one thread)."""
    import torch  # torch and the model load only when measuring, not at CLI start

    from hpctrain.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(shape.gpt)  # the architecture too: a Llama's SwiGLU and GQA run at other rates
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    times = []
    for r in rows:
        x = torch.randint(0, shape.vocab_size, (r, shape.block_size))

        def step():
            model(x, x).backward()
            model.zero_grad(set_to_none=False)
        times.append(_median_time(step, reps))
    tokens = [r * shape.block_size for r in rows]
    slope = (times[1] - times[0]) / (tokens[1] - tokens[0])  # seconds per token
    slope = slope if slope > 0 else times[1] / tokens[1]
    overhead = max(0.0, times[1] - slope * tokens[1])
    return {"tflops": shape.flops_per_token / slope / 1e12,
            "layer_overhead_us": overhead / shape.n_layer * 1e6,
            "rows": list(rows), "seconds": times}


def measure_optimizer(sizes=(250_000, 2_000_000), reps: int = 7) -> dict:
    import torch  # as above; parallel.optim imports torch too

    from hpctrain.parallel.optim import build_optimizer, clip_grads_, global_grad_norm

    times = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-3
        opt = build_optimizer([{"params": [p], "weight_decay": 0.1}], OptimConfig())

        def step():
            norm = global_grad_norm([p.grad])
            clip_grads_([p.grad], 1.0, norm)
            opt.step()
            p.grad.zero_()
        times.append(_median_time(step, reps))
    per = (times[1] - times[0]) / (sizes[1] - sizes[0])
    per = per if per > 0 else times[1] / sizes[1]
    return {"optimizer_ns_per_param": per * 1e9,
            "optimizer_overhead_us": max(0.0, times[1] - per * sizes[1]) * 1e6}


def measure_peak(dtype: str, n: int = 1024, reps: int = 5) -> float:
    """TFLOP/s of an n x n matrix product on one thread: what this core can do at best."""
    import torch  # not at CLI start

    t = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(n, n, dtype=t), torch.randn(n, n, dtype=t)
    return 2.0 * n ** 3 / _median_time(lambda: a @ b, reps) / 1e12


def measure_collectives(ranks: int, shape_keys=(), timeout_s: float = 300) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    launcher = str(mpiexec) if mpiexec.exists() else "mpiexec"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fits.json"
        argv = ["timeout", "-k", "10", str(int(timeout_s)), launcher, "-n", str(ranks),
                sys.executable, "-m", "hpctrain.scaling.calib_worker", "--output", str(out)]
        for key in shape_keys:  # forward + backward on all ranks at once, too
            argv += ["--compute", key]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run(argv, capture_output=True, text=True, env=env)
        if p.returncode != 0 or not out.is_file():
            raise UserError(f"the collective benchmark at {ranks} ranks failed (status "
                            f"{p.returncode}): {(p.stderr or p.stdout).strip()[-300:]}; "
                            "check that `mpiexec -n 2 python -c 'import mpi4py.MPI'` works")
        return json.loads(out.read_text())


def base_memory_mib() -> float:
    """Resident memory of a fresh rank after the trainer's imports, before any model."""
    code = ("import resource, hpctrain.train.trainer; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    return int(out.stdout.strip().splitlines()[-1]) / 1024 if out.returncode == 0 else 0.0


def calibrate(shapes: list[ModelShape], dtypes: list[str], ranks: list[int],
              stream=sys.stderr) -> dict:
    """Every measurement; returns the calibration file's content."""
    import torch  # not at CLI start

    torch.set_num_threads(1)  # study ranks run one thread each
    say = lambda line: (stream.write(line + "\n"), stream.flush())  # noqa: E731
    result = {"schema": 1, "base": "local", "created": now(), "git": git_state(),
              "environment": environment(),
              "cores_per_node": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count(), "compute": {"shapes": {}}, "collectives": {}}
    c = result["compute"]
    c["peak_tflops"] = {d: measure_peak(d) for d in dtypes}
    say("peak (one thread, 1024^3 matmul): " + ", ".join(
        f"{d} {v * 1e3:.1f} GFLOP/s" for d, v in c["peak_tflops"].items()))
    rates = {d: [] for d in dtypes}
    for shape in shapes:
        for d in dtypes:
            m = measure_compute(shape, d)
            c["shapes"].setdefault(shape.key, {})[d] = m
            rates[d].append((m["tflops"], m["layer_overhead_us"]))
            say(f"compute {shape.key} {d}: {m['tflops'] * 1e3:.1f} GFLOP/s, "
                f"{m['layer_overhead_us']:.0f} us per layer per micro-batch")
    c["achieved_tflops"] = {d: float(np.mean([r for r, _ in v])) for d, v in rates.items() if v}
    c["layer_overhead_us"] = float(np.mean([o for v in rates.values() for _, o in v])) \
        if shapes else 0.0
    c.update(measure_optimizer())
    say(f"optimizer: {c['optimizer_ns_per_param']:.2f} ns per parameter + "
        f"{c['optimizer_overhead_us']:.0f} us")
    keys = [s.key for s in shapes]
    alone = measure_collectives(1, keys)["compute_s"] if keys else {}
    slowdown = {}
    for n in ranks:
        if n < 2:
            continue
        fits = measure_collectives(n, keys)
        result["collectives"][str(n)] = {**fits["fits"], "points_s": fits["points"]}
        ratios = {k: fits["compute_s"][k] / alone[k] for k in keys if alone.get(k)}
        if ratios:
            slowdown[str(n)] = {"mean": float(np.mean(list(ratios.values()))), **ratios}
            say(f"forward + backward + a sync on {n} ranks at once: " + ", ".join(
                f"{k} {v:.2f}x" for k, v in ratios.items()) + " the time of one rank alone")
        say(f"collectives at {n} ranks: " + ", ".join(
            f"{k} {v['alpha_us']:.0f} us + {v['ns_per_byte']:.2f} ns/B"
            for k, v in fits["fits"].items()))
    c["concurrent_slowdown"] = slowdown
    result["base_memory_mib"] = base_memory_mib()
    say(f"base memory of a rank: {result['base_memory_mib']:.0f} MiB")
    return result
