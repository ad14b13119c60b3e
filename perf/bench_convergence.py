"""Convergence and time to solution on tiny Shakespeare (nanoGPT's CPU configuration).

In one run:
  hpctrain   mpiexec -n 2 hpctrain train shakespeare-char (1 thread per rank), whole
             command timed (start-up, periodic evals, final whole-split eval, checkpoint)
  baseline   the single-process nanoGPT-style loop (perf/nanogpt_baseline.py) with 2
             threads, same configuration, nanoGPT's own eval cadence (train + val
             estimates of 20 batches every 250 steps); its whole-split val loss is
             computed after the timed part, for comparison on the same measure

Targets: hpctrain's val loss over the whole validation split <= 1.90 at 2000 steps, in
no more wall time than the baseline.

    python perf/bench_convergence.py [--seeds 1337,1,2]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (MPIEXEC, ROOT, print_table, shakespeare_dataset,  # noqa: E402
                         timed_command, write_result)


def run_hpctrain(data: Path, seed: int) -> dict:
    out = ROOT / "runs" / f"bench-convergence-{seed}"
    wall, _ = timed_command([MPIEXEC, "-n", "2", sys.executable, "-m", "hpctrain", "train",
                             "shakespeare-char", f"--data.path={data}", f"--train.out_dir={out}",
                             f"--train.seed={seed}", "--train.progress=false"], threads=1)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    estimate = [r["val_loss"] for r in records if "val_loss" in r][-1]
    return {"wall_s": wall, "final_val_loss": summary["final_val_loss"],
            "val_estimate_2000": estimate, "step_ms_median": summary["step_ms_median"]}


def run_baseline(data: Path, seed: int) -> dict:
    wall, stdout = timed_command([sys.executable, str(ROOT / "perf" / "nanogpt_baseline.py"),
                                  "--data", str(data), "--full-val", "--seed", str(seed)],
                                 threads=2)
    r = json.loads(stdout.strip().splitlines()[-1])
    return {"wall_s": wall - r["full_val_s"], "final_val_loss": r["full_val_loss"],
            "step_ms_median": r["step_ms_median"]}


def main() -> None:
    seeds = [1337]
    if "--seeds" in sys.argv:
        seeds = [int(s) for s in sys.argv[sys.argv.index("--seeds") + 1].split(",")]
    data = shakespeare_dataset()
    runs, rows = [], []
    for seed in seeds:
        ours, base = run_hpctrain(data, seed), run_baseline(data, seed)
        runs.append({"seed": seed, "hpctrain_dp2": ours, "nanogpt_style_1proc_2threads": base})
        rows.append([seed, ours["final_val_loss"], base["final_val_loss"], ours["wall_s"],
                     base["wall_s"], base["wall_s"] / ours["wall_s"], ours["step_ms_median"],
                     base["step_ms_median"]])
    print_table("shakespeare-char, 2000 steps: whole-split val loss and wall time",
                ["seed", "val hpctrain", "val baseline", "wall hpctrain s", "wall baseline s",
                 "speedup", "step ms ours", "step ms base"], rows)
    first = runs[0]
    loss_ok = first["hpctrain_dp2"]["final_val_loss"] <= 1.90
    time_ok = first["hpctrain_dp2"]["wall_s"] <= first["nanogpt_style_1proc_2threads"]["wall_s"]
    print(f"\ntargets (seed {seeds[0]}): val <= 1.90 -> {'MET' if loss_ok else 'NOT MET'}; "
          f"wall <= baseline -> {'MET' if time_ok else 'NOT MET'}")
    write_result("convergence", {"runs": runs, "targets": {"val_loss": 1.90},
                                 "met": loss_ok and time_ok})


if __name__ == "__main__":
    main()
