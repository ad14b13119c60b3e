"""``make gpu-check``: one command that proves the GPU path on a GPU node.

    make gpu-check             # on a GPU node (the Makefile finds or installs a GPU torch)
    make gpu-check DRY=1       # anywhere: the same steps on the fake device, tiny shapes
    python perf/gpu_check.py [--dry-run] [--data FILE.h5] [--steps 100]

Steps, each under its own time limit; a failed step is recorded and the others still run:

1. ``environment``: the torch build (a CUDA, ROCm or XPU build, never ``+cpu``), the
   device, the MPI library, whether it is GPU-aware.
2. ``doctor``: ``hpctrain doctor --json`` at 1 rank, and at 2 ranks sharing the device
   (which doctor must flag).
3. ``equivalence``: one small fp32 training (TF32 off) at 1 rank, at 2 ranks sharing the
   device with MPI (device buffers staged or handed over), and at 2 ranks with
   ``--comm.transport=xccl``, and tensor-parallel at 2 ranks (with and without
   sequence parallelism, over MPI): the losses and final parameters agree. The 1-rank run
   also counts the host's waits for the device per step (CUDA's sync debug mode).
4. ``gpt2_124m``: the ``gpt2-124m`` recipe, bf16, compiled, ``--steps`` steps on one
   device: tokens/s, MFU, step phases and memory (``summary.json``).

Writes ``perf/results/gpu-<device>.json`` (``quick/`` for a dry run) and exits 1 if a step
failed. GPT-2 tokens: ``--data`` names a prepared file, else the standard library is
prepared with ``--tokenizer gpt2`` (tiktoken and GPT-2's BPE file, io/README.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import ROOT, launch_env, mpiexec, run_worker, write_result  # noqa: E402

WORKER = Path(__file__).resolve().parent / "gpu_equivalence.py"
LOSS_ATOL = 1e-4  # fp32 on a GPU: the sums of 1 and 2 ranks are ordered differently
PARAM_ATOL = 1e-4


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """``cmd``'s exit status and its output (stdout and stderr), 124 on a timeout."""
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env or launch_env(), text=True,
                           capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n(timed out after {timeout:.0f} s)"
    return p.returncode, p.stdout + p.stderr


def hpctrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpctrain", *args]


class Check:
    """The JSON report, one section per step."""

    def __init__(self):
        self.sections: dict[str, dict] = {}

    def step(self, name: str, fn, *args) -> None:
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        try:
            section = fn(*args)
        except Exception as e:  # a broken step is a finding: record it, go on
            section = {"status": "FAILED", "error": f"{type(e).__name__}: {e}"[-2000:]}
        section.setdefault("status", "ok")
        section["seconds"] = round(time.monotonic() - t0, 1)
        self.sections[name] = section
        print(json.dumps(section, indent=1)[:3000], flush=True)

    @property
    def failed(self) -> list[str]:
        return [n for n, s in self.sections.items() if s["status"] != "ok"]


def environment(device: str) -> dict:
    import torch
    from mpi4py import MPI

    build = torch.version.cuda or torch.version.hip or ("xpu" if hasattr(torch, "xpu")
                                                        else None)
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
            "mpi": MPI.Get_library_version().split("\n")[0].strip(), "device": device}
    if device == "fake":
        return info
    if "+cpu" in torch.__version__ or not build:
        return {**info, "status": "FAILED", "error": "a CPU-only torch build on a GPU node: "
                "install a CUDA/ROCm/XPU build (make gpu-check does)"}
    mod = getattr(torch, device)
    info.update(name=mod.get_device_name(0), count=mod.device_count(),
                memory_gib=round(mod.get_device_properties(0).total_memory / GiB, 1))
    if device == "cuda":
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def doctor(device: str, out: Path) -> dict:
    section = {}
    for ranks in (1, 2):
        path = out / f"doctor{ranks}.json"
        args = ["doctor", "--json", str(path), "--device", device]
        if device == "fake" or ranks == 2:  # two ranks on one GPU: what doctor must flag
            args += ["--model", "small", "--sizes", "1", "25"]
        rc, text = _run(mpiexec(ranks, *hpctrain(*args)), timeout=240)
        report = json.loads(path.read_text()) if path.exists() else {}
        section[f"ranks_{ranks}"] = {"exit": rc, "failures": report.get("failures"),
                                     "train": report.get("train"),
                                     "allreduce": report.get("allreduce"),
                                     "tail": text[-1500:] if rc not in (0, 1) or not report
                                     else ""}
    one = section["ranks_1"]
    if one["exit"] != 0:
        section["status"] = "FAILED"
    elif device != "fake" and not any("share" in f for f in section["ranks_2"]["failures"] or []):
        section["status"] = "FAILED"
        section["error"] = "doctor passed 2 ranks sharing one GPU"
    return section


def equivalence(device: str, data: Path, out: Path, steps: int) -> dict:
    common = ["--data", str(data), "--device", device, "--steps", str(steps)]
    runs = {"1 rank": (1, ["--count-syncs"]),
            "2 ranks, mpi": (2, ["--collectives", "mpi"]),
            "2 ranks, xccl": (2, ["--collectives", "xccl"]),
            "2 ranks, tp=2, mpi": (2, ["--collectives", "mpi", "--tp", "2"]),
            "2 ranks, tp=2 + sequence parallel, mpi": (2, ["--collectives", "mpi", "--tp", "2",
                                                           "--sequence-parallel"])}
    results, section = {}, {"runs": {}}
    for name, (n, extra) in runs.items():
        try:
            results[name] = run_worker(n, WORKER, common + extra, threads=4, timeout=300)
            section["runs"][name] = {k: v for k, v in results[name].items() if k != "params"}
        except RuntimeError as e:
            duplicate = "Duplicate GPU" in str(e) and "xccl" in name
            section["runs"][name] = {
                "status": "not possible" if duplicate else "FAILED",
                "why": "NCCL refuses two ranks on one GPU" if duplicate else "",
                "error": str(e)[-1500:]}
    base = results.get("1 rank")
    if base is None:
        return {**section, "status": "FAILED", "error": "the 1-rank run failed"}
    for name, r in results.items():
        loss = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        param = max(abs(a - b) for a, b in zip(r["params"], base["params"]))
        section["runs"][name].update(max_loss_diff=loss, max_param_diff=param,
                                     equal=loss <= LOSS_ATOL and param <= PARAM_ATOL)
    bad = [n for n, r in section["runs"].items()
           if not r.get("equal") and r.get("status") != "not possible"]
    if bad:
        section.update(status="FAILED", error=f"not equal to the 1-rank run: {bad}")
    return section


def gpt2_124m(device: str, data: Path, steps: int, out: Path) -> dict:
    run_dir = out / "gpt2-124m"
    overrides = [f"--data.path={data}", f"--train.max_iters={steps}",
                 "--train.eval_interval=0", "--train.ckpt_interval=0", "--train.final_eval=false",
                 "--train.save_checkpoint=false", "--train.progress=false",
                 "--train.log_interval=10", f"--train.out_dir={run_dir}",
                 f"--train.device={device}"]
    if device == "fake":  # the recipe's options on a CPU-sized model
        overrides += ["--model.n_layer=2", "--model.n_embd=64", "--model.n_head=2",
                      "--model.block_size=64", "--train.batch_size=8",
                      "--parallel.micro_batches=2", "--train.compile=false"]
    else:
        overrides += ["--parallel.micro_batches=20"]  # 24 rows of 1024 per micro-batch
    rc, text = _run(mpiexec(1, *hpctrain("train", "gpt2-124m", *overrides)), timeout=600)
    summary_path = run_dir / "summary.json"
    if rc != 0 or not summary_path.exists():
        return {"status": "FAILED", "exit": rc, "tail": text[-3000:]}
    summary = json.loads(summary_path.read_text())
    cfg = summary["config"]
    tokens_per_step = cfg["train"]["batch_size"] * cfg["model"]["block_size"]
    step_s = summary["timing"]["step_ms_median"] / 1e3
    steady = tokens_per_step / step_s
    peak = summary["peak"]
    flops = summary["flops_per_token"] * steady
    return {"steps": summary["steps"], "tokens_per_step": tokens_per_step,
            "tokens_per_s_steady": steady, "tokens_per_s_with_compile": summary["tokens_per_s"],
            "step_ms_median": summary["timing"]["step_ms_median"],
            "phases_ms": summary["timing"].get("phases_ms"), "peak": peak,
            "mfu": flops / (peak["tflops"] * 1e12) if peak.get("tflops") else None,
            "memory_per_rank": summary["memory_per_rank"],
            "device_memory": [line for line in text.splitlines() if "device:" in line][:1],
            "log_tail": text[-1500:]}


def prepared_data(args, out: Path) -> tuple[Path, Path]:
    """(GPT-2 tokens for the recipe, char tokens for the small equivalence run)."""
    small = out / "small-char.h5"
    rc, text = _run(hpctrain("prepare", "--corpus", "stdlib", "--max-bytes", "300000",
                             "--output", str(small)), timeout=120)
    if rc != 0:
        raise RuntimeError(f"preparing the small dataset failed:\n{text[-2000:]}")
    if args.data:
        return Path(args.data).resolve(), small
    if args.dry_run:
        return small, small
    gpt2 = ROOT / "datasets" / "stdlib-gpt2.h5"
    if not gpt2.exists():
        rc, text = _run(hpctrain("prepare", "--corpus", "stdlib", "--max-bytes", "20000000",
                                 "--tokenizer", "gpt2", "--output", str(gpt2)), timeout=300)
        if rc != 0:
            raise RuntimeError(f"preparing GPT-2 tokens failed (tiktoken and GPT-2's BPE file "
                               f"are needed, io/README.md):\n{text[-2000:]}")
    return gpt2, small


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="the fake device and tiny shapes: checks the steps themselves")
    p.add_argument("--data", help="a prepared GPT-2 token file for the gpt2-124m step")
    p.add_argument("--steps", type=int, default=100, help="gpt2-124m steps (default 100)")
    args = p.parse_args()
    device = "fake" if args.dry_run else "cuda"
    if not args.dry_run:
        import torch

        device = "xpu" if not torch.cuda.is_available() and hasattr(torch, "xpu") and \
            torch.xpu.is_available() else "cuda"
    check = Check()

    def save() -> None:  # after every step: a run cut short keeps what it measured
        name = check.sections["environment"].get("name", device)
        slug = "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
        write_result(f"gpu-{slug}", {"dry_run": args.dry_run, "sections": check.sections,
                                     "failed": check.failed}, smoke=args.dry_run)

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp)
        check.step("environment", environment, device)
        gpt2, small = prepared_data(args, out)
        for name, fn, *rest in [("doctor", doctor, device, out),
                                ("equivalence", equivalence, device, small, out, 8),
                                ("gpt2_124m", gpt2_124m, device, gpt2,
                                 5 if args.dry_run else args.steps, out)]:
            save()
            check.step(name, fn, *rest)
    save()
    if check.failed:
        print(f"gpu-check: FAILED: {', '.join(check.failed)}", flush=True)
        return 1
    print("gpu-check: every step passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
