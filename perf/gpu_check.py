"""``make gpu-check``: one command that proves the GPU path on a GPU node.

    make gpu-check             # on a GPU node (the Makefile finds or installs a GPU torch)
    make gpu-check DRY=1       # anywhere: the same steps on the fake device, tiny shapes
    python perf/gpu_check.py [--dry-run] [--data FILE.h5] [--steps 40] [--budget 540]
                             [--only STEP[,STEP]]

Steps, each under its own time limit (``LIMITS``) inside one budget; a step that fails
or runs out of time is recorded and the others still run:

1. ``environment``: the torch build (never ``+cpu``), the device, MPI.
2. ``doctor``: ``hpctrain doctor`` at 1 rank, and at 2 ranks sharing a GPU (flagged).
3. ``equivalence``: a small fp32 training at 1 rank and at 2 ranks (MPI, the device's
   library, tensor parallel with and without sequence parallel): equal to round-off.
4. ``gpt2_124m``: the recipe, bf16, compiled: tokens/s, MFU (goal 0.50), phases, peak
   memory against the formula (``hpctrain.scaling.rank_memory``).
5. ``trace``: gpt2-124m under ``--train.profile``: top kernels, idle share, the clock.
6. ``llama_1b``: the llama-1b recipe at 2048 tokens: MFU (goal 0.45), memory vs formula.
7. ``fp8``: ``--train.fp8`` against bf16: gpt2-124m's loss gap over 200 steps and the
   speed-ups of both models (not possible on a device without FP8 units).
8. ``multi_gpu``: dp=2, ZeRO-3 and tp=2 through NCCL, a GPU per rank, against 1 rank.
9. ``llama_1b_long``: the longest context llama-1b trains at with recomputation.
The verdict table (step, status, key number, goal, met) is printed last.

Budget on one H200 (the earlier run: environment, doctor, equivalence and 100 steps of
gpt2-124m at 959 ms in 210 s; a fresh run's start and compilation ~20 s): environment
1 + data 5 + doctor 45 + equivalence 42 + gpt2_124m 60 (40 steps) + trace 30 (its
kernels cached) + llama_1b 60 (12 steps of ~2 s + ~35 s to start and compile) + fp8
120 (2 x 200 short gpt2 steps, 12 llama steps, ~20 s to start each) + multi_gpu 0 (one
GPU) + llama_1b_long 160 (4 lengths x ~40 s) = ~525 s: ``--budget`` 540 s (9 min). With
2 GPUs multi_gpu takes ~50 s and llama_1b_long gives up its longest length(s) to the
budget. Writes ``perf/results/gpu-<device>.json`` (``quick/`` for a dry run) after every
step; ``--only`` reruns some steps and keeps the others' results from that file. Exits 1
if a step failed or did not run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import RESULTS, ROOT, mpiexec, run, run_worker, write_result  # noqa: E402
from perf import gpu_rows  # noqa: E402
from perf.gpu_runs import Context, hpctrain  # noqa: E402
from perf.gpu_verdict import (FAILED, NOT_POSSIBLE, Check,  # noqa: E402
                              earlier_sections, failed_steps, parse_only,
                              verdict_table)
from hpctrain.sizes import GiB  # noqa: E402

WORKER = Path(__file__).resolve().parent / "gpu_equivalence.py"
LOSS_ATOL = 1e-4  # fp32 on a GPU: the sums of 1 and 2 ranks are ordered differently
PARAM_ATOL = 1e-4
BUDGET_S = 540.0
LIMITS = {"environment": 30, "doctor": 120, "equivalence": 120, "gpt2_124m": 120,
          "trace": 90, "llama_1b": 150, "fp8": 240, "multi_gpu": 120, "llama_1b_long": 200}
"""Seconds each step may take at most, about twice its expected time (module docstring)."""


def environment(ctx: Context) -> dict:
    import torch
    from mpi4py import MPI

    build = torch.version.cuda or torch.version.hip or ("xpu" if hasattr(torch, "xpu")
                                                        else None)
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
            "mpi": MPI.Get_library_version().split("\n")[0].strip(), "device": ctx.device}
    if ctx.device == "fake":
        return {**info, "key": f"fake device, torch {torch.__version__}"}
    if "+cpu" in torch.__version__ or not build:
        return {**info, "status": FAILED, "error": "a CPU-only torch build on a GPU node: "
                "install a CUDA/ROCm/XPU build (make gpu-check does)"}
    mod = getattr(torch, ctx.device)
    info.update(name=mod.get_device_name(0), count=mod.device_count(),
                memory_gib=round(mod.get_device_properties(0).total_memory / GiB, 1))
    if ctx.device == "cuda":
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    info["key"] = f"{info['count']} x {info['name']}, torch {torch.__version__}"
    return info


def devices(ctx: Context) -> int:
    """GPUs on this node (the fake device poses as two: its steps run on gloo)."""
    return 2 if ctx.device == "fake" else ctx.sections.get("environment", {}).get("count", 1)


def doctor(ctx: Context) -> dict:
    section = {}
    for ranks in (1, 2):
        path = ctx.out / f"doctor{ranks}.json"
        args = ["doctor", "--json", str(path), "--device", ctx.device]
        env = {}
        if ctx.device == "fake" or ranks == 2:  # two ranks on one GPU: what doctor must flag
            args += ["--model", "small", "--sizes", "1", "25"]
        if ranks == 2 and ctx.device != "fake":  # one GPU for both, however many there are
            env = {"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0",
                   "ZE_AFFINITY_MASK": "0"}
        rc, text = run(mpiexec(ranks, *hpctrain(*args)), ctx.left(240), **env)
        report = json.loads(path.read_text()) if path.exists() else {}
        section[f"ranks_{ranks}"] = {"exit": rc, "failures": report.get("failures"),
                                     "train": report.get("train"),
                                     "allreduce": report.get("allreduce"),
                                     "tail": text[-1500:] if rc not in (0, 1) or not report
                                     else ""}
    one = section["ranks_1"]
    shared = any("share" in f for f in section["ranks_2"]["failures"] or [])
    mfu = (one.get("train") or {}).get("mfu")
    section["key"] = (f"1 rank exit {one['exit']}" + (f", MFU {100 * mfu:.0f}%" if mfu else "")
                      + (", sharing flagged" if shared else ""))
    if one["exit"] != 0:
        section["status"] = FAILED
    elif ctx.device != "fake" and not shared:
        section.update(status=FAILED, error="doctor passed 2 ranks sharing one GPU")
    return section


def _equal_runs(ctx: Context, runs: dict, reference: str, cap: float) -> dict:
    """Each of ``runs`` (name: (ranks, worker options)) trained and compared with the
    ``reference`` run: losses and final parameters within LOSS_ATOL and PARAM_ATOL."""
    common = ["--data", str(ctx.small), "--device", ctx.device, "--steps", "8"]
    results, section = {}, {"runs": {}}
    for name, (n, extra) in runs.items():
        try:
            results[name] = run_worker(n, WORKER, common + extra, threads=4,
                                       timeout=ctx.left(cap))
            section["runs"][name] = {k: v for k, v in results[name].items() if k != "params"}
        except RuntimeError as e:
            duplicate = "Duplicate GPU" in str(e) and "xccl" in name
            section["runs"][name] = {
                "status": NOT_POSSIBLE if duplicate else FAILED,
                "why": "NCCL refuses two ranks on one GPU" if duplicate else "",
                "error": str(e)[-1500:]}
    base = results.get(reference)
    if base is None:
        return {**section, "status": FAILED, "error": f"the {reference} run failed"}
    for name, r in results.items():
        loss = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        param = max(abs(a - b) for a, b in zip(r["params"], base["params"]))
        section["runs"][name].update(max_loss_diff=loss, max_param_diff=param,
                                     equal=loss <= LOSS_ATOL and param <= PARAM_ATOL)
    equal = [r for r in section["runs"].values() if r.get("equal")]
    worst = max((r["max_loss_diff"] for r in equal), default=0.0)
    possible = [r for r in section["runs"].values() if r.get("status") != NOT_POSSIBLE]
    section["key"] = f"{len(equal)}/{len(possible)} equal, max loss diff {worst:.1e}"
    bad = [n for n, r in section["runs"].items()
           if not r.get("equal") and r.get("status") != NOT_POSSIBLE]
    if bad:
        section.update(status=FAILED, error=f"not equal to the {reference} run: {bad}")
    return section


def equivalence(ctx: Context) -> dict:
    runs = {"1 rank": (1, ["--count-syncs"]),
            "2 ranks, mpi": (2, ["--collectives", "mpi"]),
            "2 ranks, xccl": (2, ["--collectives", "xccl"]),
            "2 ranks, tp=2, mpi": (2, ["--collectives", "mpi", "--tp", "2"]),
            "2 ranks, tp=2 + sequence parallel, mpi": (2, ["--collectives", "mpi", "--tp", "2",
                                                           "--sequence-parallel"])}
    return _equal_runs(ctx, runs, "1 rank", 300)


def multi_gpu(ctx: Context) -> dict:
    """dp=2, ZeRO-3 and tp=2 through the device's library (NCCL, RCCL or oneCCL), each
    rank on its own GPU, against 1 rank."""
    if devices(ctx) < 2:
        return {"status": NOT_POSSIBLE, "why": f"{devices(ctx)} GPU on this node",
                "key": "1 GPU"}
    xccl = ["--collectives", "xccl"]
    runs = {"1 rank": (1, []), "dp=2, xccl": (2, xccl),
            "ZeRO-3, xccl": (2, [*xccl, "--zero", "3"]), "tp=2, xccl": (2, [*xccl, "--tp", "2"])}
    return _equal_runs(ctx, runs, "1 rank", 300)


def prepared_data(args, out: Path) -> tuple[Path, Path]:
    """(GPT-2 tokens for the recipes, char tokens for the small equivalence runs)."""
    small = out / "small-char.h5"
    rc, text = run(hpctrain("prepare", "--corpus", "stdlib", "--max-bytes", "300000",
                            "--output", str(small)), timeout=120)
    if rc != 0:
        raise RuntimeError(f"preparing the small dataset failed:\n{text[-2000:]}")
    if args.data:
        return Path(args.data).resolve(), small
    if args.dry_run:
        return small, small
    gpt2 = ROOT / "datasets" / "stdlib-gpt2.h5"
    if not gpt2.exists():
        rc, text = run(hpctrain("prepare", "--corpus", "stdlib", "--max-bytes", "20000000",
                                "--tokenizer", "gpt2", "--output", str(gpt2)), timeout=300)
        if rc != 0:
            raise RuntimeError(f"preparing GPT-2 tokens failed (tiktoken and GPT-2's BPE file "
                               f"are needed, io/README.md):\n{text[-2000:]}")
    return gpt2, small


def steps(args) -> dict:
    """Every step after ``environment``, in order."""
    n = 5 if args.dry_run else args.steps
    return {"doctor": doctor, "equivalence": equivalence,
            "gpt2_124m": lambda ctx: gpu_rows.gpt2_124m(ctx, n), "trace": gpu_rows.trace,
            "llama_1b": gpu_rows.llama_1b, "fp8": gpu_rows.fp8, "multi_gpu": multi_gpu,
            "llama_1b_long": gpu_rows.llama_1b_long}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="the fake device and tiny shapes: checks the steps themselves")
    p.add_argument("--data", help="a prepared GPT-2 token file for the recipes' steps")
    p.add_argument("--steps", type=int, default=40, help="gpt2-124m steps (default 40)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for the whole check (default {BUDGET_S:.0f})")
    p.add_argument("--only", metavar="STEP[,STEP]",
                   help="run only these steps (environment always runs), keeping the "
                        "others' results from the earlier result file")
    args = p.parse_args()
    chosen = parse_only(args.only, list(steps(args)))
    device = "fake" if args.dry_run else "cuda"
    if not args.dry_run:
        import torch

        device = "xpu" if not torch.cuda.is_available() and hasattr(torch, "xpu") and \
            torch.xpu.is_available() else "cuda"
    check = Check(args.budget, LIMITS)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = Context(device=device, dry=args.dry_run, gpt2=Path(), small=Path(), out=Path(tmp))
        check.step("environment", environment, ctx)
        name = check.sections["environment"].get("name", device)
        slug = "gpu-" + "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
        kept = earlier_sections((RESULTS / "quick" if args.dry_run else RESULTS)
                                / f"{slug}.json") if args.only else {}

        def save() -> dict:  # after every step: a run cut short keeps what it measured
            sections = {**{k: {**v, "earlier": True} for k, v in kept.items()
                           if k not in check.sections}, **check.sections}
            order = ["environment", "data", *steps(args)]
            sections = {k: sections[k] for k in order if k in sections}
            write_result(slug, {"dry_run": args.dry_run, "budget_s": args.budget,
                                "only": chosen if args.only else None, "sections": sections,
                                "failed": failed_steps(sections)}, smoke=args.dry_run)
            return sections

        try:
            ctx.gpt2, ctx.small = prepared_data(args, ctx.out)
        except RuntimeError as e:  # every step trains on it: none can run
            check.sections["data"] = {"status": FAILED, "error": str(e)[-2000:]}
            chosen = []
        for step_name, fn in steps(args).items():
            if step_name in chosen:
                save()
                check.step(step_name, fn, ctx)
        sections = save()
    print("\n" + verdict_table(sections), flush=True)
    failed = failed_steps(sections)
    if failed:
        again = [k for k in failed if k in steps(args)]
        print(f"gpu-check: FAILED or not run: {', '.join(failed)}" + (
            f"; run them again with --only {','.join(again)}" if again else ""), flush=True)
        return 1
    print("gpu-check: every step ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
