"""Data-parallel training throughput at a fixed per-rank batch, on this 2-core machine.

Every configuration runs inside the same 2-rank MPI job, in phases of K steps that take
turns (a round is one phase of each), so all of them meet the machine in the same state:
its speed drifts within seconds, and separate runs a minute apart differed by up to 10%.

  DP=2              hpctrain on both ranks, per-rank batch b (global 2b)
  DP=1              rank 0 trains alone, batch b, on its own communicator, while rank 1
                    sleeps: the weak-scaling anchor (1 rank, 1 thread)
  2 x DP=1 at once  both ranks train alone at the same time, no communication at all:
                    what the two cores give two processes (shared cache, memory and
                    clocks), the ceiling of any scheme
  torch DDP (gloo)  2 ranks, per-rank batch b, same model, data and fused AdamW
  1 process         2 threads, batch 2b, the nanoGPT-style loop (what a user of this
                    machine would otherwise run), between the jobs

Weak-scaling efficiency = tok/s(DP=2) / (2 x tok/s(DP=1)). Targets: >= 0.95 and >= 1.0x
torch DDP. The contention ceiling = tok/s(2 x DP=1 at once) / (2 x tok/s(DP=1)), and
communication efficiency = tok/s(DP=2) / tok/s(2 x DP=1 at once) separates what the
hardware takes from what hpctrain's communication takes. A phase's step time is the
median of its K steps (after warm-up steps at the start of the job); each ratio is taken
within a round and the median over all rounds of all jobs counts.

``--end-to-end`` also measures the same configurations the way a user runs them, as
separate ``mpiexec`` jobs of ``hpctrain train`` (``perf/dp_end_to_end.py``), and writes
both figures, with the per-phase breakdown of a step, to the same JSON.

    python perf/bench_dp.py --shakespeare PATH [--quick] [--end-to-end]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf import dp_end_to_end  # noqa: E402
from perf.common import (ROOT, TorchDDP, bench_parser, fmt, fmt_spread,  # noqa: E402
                         print_table, run_worker, scratch_dir, shakespeare_dataset,
                         timed_command, worker_args, write_result)

# name -> (n_layer, n_head, n_embd, block_size, per-rank batch, steps per phase, warm-up)
MODELS = {
    "shakespeare-char": (4, 4, 128, 64, 6, 40, 10),
    "gpt-10M": (6, 6, 384, 256, 4, 6, 2),
}
JOBS, ROUNDS = 3, 5
PHASES = ("dp2", "dp1", "pair", "ddp2")


def _overrides(spec, data, global_batch) -> list[str]:
    L, H, C, T = spec[:4]
    return [f"--data.path={data}", f"--model.n_layer={L}", f"--model.n_head={H}",
            f"--model.n_embd={C}", f"--model.block_size={T}",
            f"--train.batch_size={global_batch}", "--train.max_iters=1000000",
            "--train.eval_interval=0", "--train.final_eval=false",
            "--train.save_checkpoint=false", "--train.sample_tokens=0",
            "--train.progress=false"]


def _sleeping_barrier(comm) -> None:
    """A barrier whose waiting rank sleeps, so it takes no cycles from a rank that works."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def worker(out: Path, model: str, rounds: int, data: str) -> None:
    from mpi4py import MPI

    from hpctrain.comm.world import World
    from hpctrain.config import load_config
    from hpctrain.parallel.optim import build_optimizer, param_groups
    from hpctrain.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    assert comm.size == 2, "the benchmark compares 2 ranks with 1"
    spec = MODELS[model]
    b, k, warmup = spec[4], spec[5], spec[6]
    tmp = f"--train.out_dir={scratch_dir('dp2', comm)}"
    dp2 = Trainer(load_config("shakespeare-char", _overrides(spec, data, 2 * b) + [tmp]),
                  World.create(comm), verbose=False)
    tmp = f"--train.out_dir={scratch_dir('alone')}"
    alone = Trainer(load_config("shakespeare-char", _overrides(spec, data, b) + [tmp]),
                    World.create(MPI.COMM_SELF), verbose=False)
    ddp = TorchDDP(_overrides(spec, data, 2 * b), lambda m, cfg: build_optimizer(
        param_groups(m, cfg.optim.weight_decay), cfg.optim))  # same fused AdamW
    next_step = {"dp2": 0, "alone": 0, "ddp2": 0}

    def step(phase: str) -> float:
        who = "alone" if phase in ("dp1", "pair") else phase
        i, next_step[who] = next_step[who], next_step[who] + 1
        t0 = time.perf_counter()
        if who == "dp2":
            dp2.train_step(i)
        elif who == "alone":
            alone.train_step(i)
        else:
            ddp.step(i)
        return time.perf_counter() - t0

    def phase(name: str, n: int) -> list[float]:
        _sleeping_barrier(comm)
        times = [] if name == "dp1" and comm.rank else [step(name) for _ in range(n)]
        _sleeping_barrier(comm)
        return times

    for name in ("dp2", "pair", "ddp2"):
        phase(name, warmup)
    records = []
    for _ in range(rounds):
        wait0 = dp2.engine.stats.wait_s
        ms = {name: phase(name, k) for name in PHASES}
        wait_ms = 1e3 * (dp2.engine.stats.wait_s - wait0) / k
        local = {name: 1e3 * statistics.median(t) if t else None for name, t in ms.items()}
        every = comm.gather(local, root=0)
        if comm.rank == 0:
            T = spec[3]
            records.append({
                "step_ms": {"dp2": max(r["dp2"] for r in every), "dp1": every[0]["dp1"],
                            "pair": [r["pair"] for r in every],
                            "ddp2": max(r["ddp2"] for r in every)},
                "tokens_per_s": {
                    "dp2": 2 * b * T / (max(r["dp2"] for r in every) / 1e3),
                    "dp1": b * T / (every[0]["dp1"] / 1e3),
                    "pair": sum(b * T / (r["pair"] / 1e3) for r in every),
                    "ddp2": 2 * b * T / (max(r["ddp2"] for r in every) / 1e3)},
                "comm_wait_ms": wait_ms})
    ddp.close()
    for trainer in (dp2, alone):
        trainer.close()
    if comm.rank == 0:
        out.write_text(json.dumps({"rounds": records, "buckets": len(dp2.engine.buckets),
                                   "transport": dp2.engine.summed_by}))


def measure(name: str, data: Path, jobs: int, rounds: int) -> dict:
    L, H, C, T, b, k, _ = MODELS[name]
    records, single2t = [], []
    for _ in range(jobs):
        r = run_worker(2, __file__, [name, str(rounds), str(data)],
                       retries=1)  # gloo inside: retry
        records += r["rounds"]
        _, stdout = timed_command(
            [sys.executable, str(ROOT / "perf" / "nanogpt_baseline.py"), "--data", str(data),
             "--max-iters", str(4 * k + 5), "--batch-size", str(2 * b), "--no-eval",
             "--model", f"{L},{H},{C},{T}"], threads=2)
        single2t.append(2 * b * T / (json.loads(stdout.strip().splitlines()[-1])
                                     ["step_ms_median"] / 1e3))
    tok = {p: [rec["tokens_per_s"][p] for rec in records] for p in PHASES}

    def per_round(num: str, den: str, copies: int = 1) -> list[float]:
        return [a / (copies * d) for a, d in zip(tok[num], tok[den])]

    ratios = {"weak_scaling_efficiency": per_round("dp2", "dp1", copies=2),
              "contention_ceiling": per_round("pair", "dp1", copies=2),
              "communication_efficiency": per_round("dp2", "pair"),
              "vs_ddp": per_round("dp2", "ddp2")}
    tok_s = {p: statistics.median(v) for p, v in tok.items()}
    tok_s["single2t"] = statistics.median(single2t)
    return {"per_rank_batch": b, "block_size": T, "steps_per_phase": k,
            "rounds": len(records), "transport": r["transport"], "tokens_per_s": tok_s,
            "comm_wait_ms": statistics.median(rec["comm_wait_ms"] for rec in records),
            **{key: statistics.median(v) for key, v in ratios.items()},
            "vs_single_2threads": tok_s["dp2"] / tok_s["single2t"],
            "per_round": ratios, "all_rounds": records, "single2t_runs": single2t}


E2E_ROUNDS = 5


def end_to_end(data: Path, quick: bool) -> dict:
    """Every model as separate jobs (``perf/dp_end_to_end.py``); prints a table."""
    results, rows = {}, []
    for name, spec in MODELS.items():
        b, T = spec[4], spec[3]
        r = results[name] = dp_end_to_end.measure(
            name, lambda n, spec=spec: _overrides(spec, data, n * b), b * T,
            1 if quick else E2E_ROUNDS, quick=quick)
        runs = r["runs"]
        rows.append([name, r["rounds"],
                     *(fmt_spread([x["tokens_per_s"][c] for x in runs])
                       for c in dp_end_to_end.CONFIGS),
                     *(fmt_spread([x[k] for x in runs])
                       for k in ("efficiency", "weak_scaling", "ceiling", "vs_ddp"))])
    print_table("End to end: separate jobs (tokens/s and ratios, median [min, max] over "
                "the rounds)", ["model", "rounds", "alone", "2 x alone at once", "DP=2",
                                "DDP gloo 2", "DP=2 / ceiling", "weak eff", "ceiling",
                                "vs DDP"], rows)
    for name, r in results.items():
        ph = r["phases_ms"]
        print_table(f"{name}: ms per step by phase (median over the rounds; DP=2 averaged "
                    "over its ranks)", ["phase", "1 rank", "DP=2", "difference"],
                    [[k, ph["alone"].get(k), ph["dp2"].get(k),
                      (ph["dp2"].get(k) or 0) - (ph["alone"].get(k) or 0)]
                     for k in ph["alone"]])
    return results


def main(argv: list[str]) -> None:
    ap = bench_parser(__doc__, shakespeare=True)
    ap.add_argument("--end-to-end", action="store_true",
                    help="also measure as separate jobs of `hpctrain train`")
    args = ap.parse_args(argv)
    quick = args.quick
    jobs, rounds = (1, 2) if quick else (JOBS, ROUNDS)
    data = shakespeare_dataset(args.shakespeare)
    results, rows = {}, []
    for name in MODELS:
        r = results[name] = measure(name, data, jobs, rounds)
        ts = r["tokens_per_s"]
        rows.append([name, r["per_rank_batch"], ts["dp1"], ts["pair"], ts["dp2"], ts["ddp2"],
                     ts["single2t"], r["weak_scaling_efficiency"], r["contention_ceiling"],
                     r["communication_efficiency"], r["vs_ddp"], r["vs_single_2threads"],
                     r["comm_wait_ms"]])
        print(f"{name}: {r['rounds']} rounds; weak-scaling efficiency per round: "
              + " ".join(fmt(x) for x in r["per_round"]["weak_scaling_efficiency"]),
              flush=True)
    print_table(f"Training throughput (tokens/s, median of {jobs} x {rounds} rounds) and ratios "
                "(median over the rounds of each round's ratio)",
                ["model", "b/rank", "DP=1", "2xDP=1 at once", "DP=2", "DDP gloo 2", "1 proc 2t",
                 "weak eff", "ceiling", "comm eff", "vs DDP", "vs 1p2t", "comm wait ms"], rows)
    eff = min(r["weak_scaling_efficiency"] for r in results.values())
    vs = min(r["vs_ddp"] for r in results.values())
    print(f"\ntargets: efficiency >= 0.95: worst {fmt(eff)} -> "
          f"{'MET' if eff >= 0.95 else 'NOT MET'}; >= 1.0x torch DDP: worst {fmt(vs)}x -> "
          f"{'MET' if vs >= 1.0 else 'NOT MET'}")
    e2e = end_to_end(data, quick) if args.end_to_end else None
    write_result("dp", {"models": results, "quick": quick,
                        "targets": {"efficiency": 0.95, "vs_ddp": 1.0,
                                    "end_to_end_efficiency": 0.97},
                        "met": eff >= 0.95 and vs >= 1.0, "end_to_end": e2e}, smoke=quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        worker(out, rest[0], int(rest[1]), rest[2])
    else:
        main(rest)
