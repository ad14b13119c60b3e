"""Mixtures of experts (``--model.moe_experts``, ``--parallel.ep``): the all-to-all, a
training step against plain torch, the load balance the auxiliary loss reaches, and the
grouped expert matmul against a loop.

  A. Dispatch and combine: the same routed token copies (TOKENS tokens per rank, top-K
     of E experts chosen at random, width C, fp32) sent to the ranks holding their
     experts and back, at ep = 2 and 4: hpctrain's ``ExpertParallelDispatch`` (counts
     by ``MPI_Ialltoall``, rows by ``MPI_Ialltoallv``, the permutations to and from
     expert-major order) against the same steps written with torch.distributed over
     gloo (counts, then rows, by ``all_to_all_single`` with split sizes, the same
     permutations). Median [min, max] over REPEATS after a warm-up; goal: >= 1.0x.
  B. A training step: the Llama-shaped MoE model of STEP_MODEL on tiny Shakespeare,
     hpctrain at ep = 2 and 4 (as many ranks, experts split over them) against torch DDP
     (gloo) on the same ranks, every rank holding every expert (``perf.common.TorchDDP``:
     same model, data, sampler and fused AdamW). Tokens/s (median over the steps after
     a warm-up) and parameters per rank.
  C. Load balance on real text: one process trains STEP_MODEL for BALANCE_STEPS steps
     on tiny Shakespeare with the balancing loss's coefficient 0.01 and 0 (nothing else
     changed); the busiest expert's load over the mean (1 = even, E/K = every copy on K
     experts), median of the last BALANCE_TAIL logged steps, worst layer; and the loss.
  D. The experts' compute: forward and backward of E experts on their routed copies,
     as one ``grouped_mm`` and as a loop over experts (``Experts.grouped``).

Two cores are shared by all ranks (ep = 4 oversubscribes them): times are indications
for this machine only; the ratios are taken within one run.

    python perf/bench_moe.py --shakespeare PATH [--quick]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (TorchDDP, bench_parser, fmt_spread, init_gloo,  # noqa: E402
                         print_table, run_worker, scratch_dir, shakespeare_dataset,
                         spread, worker_args, write_result)

TOKENS, E, K, C = 4096, 8, 2, 512
REPEATS = 41
STEP_MODEL = {"arch": "llama", "n_layer": 2, "n_embd": 128, "n_head": 4, "n_kv_head": 2,
              "moe_experts": 8, "moe_top_k": 2, "moe_ffn_hidden": 256}
STEP_BATCH, STEP_STEPS, STEP_WARMUP = 8, 25, 5
BALANCE_STEPS, BALANCE_TAIL = 400, 10
GROUPED_TOKENS, GROUPED_H = 8192, 512
GOAL_DISPATCH = 1.0
QUICK = dict(repeats=4, step_steps=8, balance_steps=60)


def model_args(model: dict) -> list[str]:
    return [f"--model.{k}={v}" for k, v in model.items()]


def routed_copies(rank: int, seed: int = 0):
    """This rank's copies sorted by expert, and the counts: random top-K choices."""
    import torch

    gen = torch.Generator().manual_seed(seed + rank)
    chosen = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(TOKENS)])
    copies = chosen.reshape(-1)
    order = torch.argsort(copies, stable=True)
    x = torch.randn(TOKENS, C, generator=gen)
    return x[order // K].contiguous(), torch.bincount(copies, minlength=E)


# --------------------------------------------------------------------------- A: worker

def torch_dispatch_combine(routed, counts, ep: int):
    """The same exchange as ``ExpertParallelDispatch`` in torch.distributed calls."""
    import torch
    import torch.distributed as dist

    from hpctrain.parallel.experts import permute

    sent = permute.per_peer(counts, ep)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)
    send_rows, recv_rows = permute.rows_per_peer(sent), permute.rows_per_peer(received)
    arrived = routed.new_empty(sum(recv_rows), routed.size(1))
    dist.all_to_all_single(arrived, routed, recv_rows, send_rows)
    order = permute.expert_major_order(received)
    back = arrived.index_select(0, order).index_select(0, permute.inverse(order))
    out = routed.new_empty(routed.shape)
    dist.all_to_all_single(out, back, send_rows, recv_rows)
    return out


def worker_dispatch(out: Path, repeats: int) -> None:
    import torch
    from mpi4py import MPI

    from hpctrain.comm.world import World
    from hpctrain.parallel.experts.dispatch import ExpertParallelDispatch, dispatch_combine

    comm = MPI.COMM_WORLD
    ep = comm.size
    world = World.create(comm, device="cpu", collectives="mpi")
    ours = ExpertParallelDispatch.of_world(comm, world)
    init_gloo(comm)
    routed, counts = routed_copies(comm.rank)
    assert torch.equal(dispatch_combine(ours, routed, counts), routed)
    assert torch.equal(torch_dispatch_combine(routed, counts, ep), routed)
    times = {"hpctrain": [], "torch": []}
    for _ in range(repeats + 1):
        for name, run in (("hpctrain", lambda: dispatch_combine(ours, routed, counts)),
                          ("torch", lambda: torch_dispatch_combine(routed, counts, ep))):
            comm.Barrier()
            t0 = MPI.Wtime()
            run()
            t = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
            times[name].append(t)
    if comm.rank == 0:
        out.write_text(json.dumps({k: v[1:] for k, v in times.items()}))
    from hpctrain.comm import device_collectives

    device_collectives.stop()  # gloo's teardown at exit aborts now and then
    ours.transport.close()


# --------------------------------------------------------------------------- B: worker

def step_overrides(data: Path, extra: list[str]) -> list[str]:
    return [f"--data.path={data}", *model_args(STEP_MODEL),
            f"--train.batch_size={STEP_BATCH}", "--train.eval_interval=0",
            "--train.final_eval=false", "--train.sample_tokens=0",
            "--train.save_checkpoint=false", "--train.progress=false", "--train.threads=1",
            *extra]


def worker_step(out: Path, data: Path, kind: str, steps: int) -> None:
    from mpi4py import MPI

    from hpctrain.comm.world import World
    from hpctrain.config import load_config
    from hpctrain.parallel.optim import build_optimizer, param_groups
    from hpctrain.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    n = comm.size
    batch = [f"--train.batch_size={STEP_BATCH * n}", f"--train.max_iters={steps}"]
    if kind == "hpctrain":
        tmp = f"--train.out_dir={scratch_dir('moe', comm)}"
        cfg = load_config("shakespeare-char",
                          step_overrides(data, batch + [f"--parallel.ep={n}", tmp]))
        runner = Trainer(cfg, World.create(comm), verbose=False)
        step, model = runner.train_step, runner.model
    else:
        runner = TorchDDP(step_overrides(data, batch), lambda m, cfg: build_optimizer(
            param_groups(m, cfg.optim.weight_decay), cfg.optim))
        step, model = runner.step, runner.model
    params = sum(p.numel() for p in model.parameters())
    times = []
    for i in range(steps):
        comm.Barrier()
        t0 = time.perf_counter()
        step(i)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    runner.close()
    if comm.rank == 0:
        out.write_text(json.dumps({"step_s": times, "params_per_rank": params,
                                   "tokens_per_step": STEP_BATCH * n * 64}))


# --------------------------------------------------------------------------- C, D: here

def load_balance(data: Path, steps: int) -> dict:
    """One process, the balancing loss on and off; imbalance and loss at the end."""
    from mpi4py import MPI

    from hpctrain.comm.world import World
    from hpctrain.config import load_config
    from hpctrain.train.trainer import Trainer

    rows = {}
    for coef in (0.01, 0.0):
        out = scratch_dir(f"balance-{coef}")
        cfg = load_config("shakespeare-char", step_overrides(data, [
            f"--model.moe_aux_loss={coef}", f"--train.max_iters={steps}",
            "--train.log_interval=10", f"--train.out_dir={out}"]))
        result = Trainer(cfg, World.create(MPI.COMM_SELF), verbose=False).fit()
        records = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
        tail = [r["moe_imbalance"] for r in records if "moe_imbalance" in r][-BALANCE_TAIL:]
        rows[str(coef)] = {"imbalance": spread(tail), "final_loss": result.losses[-1],
                           "imbalance_by_step": [[r["step"], r["moe_imbalance"]]
                                                 for r in records if "moe_imbalance" in r],
                           "aux_loss_last": records[-1].get("moe_aux_loss")}
        print(f"  balancing loss {coef}: imbalance {fmt_spread(tail)}, loss "
              f"{result.losses[-1]:.4f}", flush=True)
    return rows


def grouped_vs_loop(repeats: int) -> dict:
    import torch

    from hpctrain.model.common.experts import Experts
    from hpctrain.model.llama.layers import LlamaLayers

    torch.manual_seed(0)
    experts = Experts(E, C // 2, GROUPED_H, True, LlamaLayers.expert_activation)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    counts = torch.bincount(torch.randint(0, E, (GROUPED_TOKENS,)), minlength=E).tolist()
    tokens = torch.randn(GROUPED_TOKENS, C // 2, requires_grad=True)
    grad = torch.randn(GROUPED_TOKENS, C // 2)
    times = {}
    for grouped in (True, False):
        experts.grouped = grouped
        ts = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            experts(tokens, counts).backward(grad)
            ts.append(time.perf_counter() - t0)
        times["grouped" if grouped else "loop"] = ts[1:]
    return times


# --------------------------------------------------------------------------- main

def main(argv: list[str]) -> None:
    args = bench_parser(__doc__, shakespeare=True).parse_args(argv)
    quick = args.quick
    repeats = QUICK["repeats"] if quick else REPEATS
    step_steps = QUICK["step_steps"] if quick else STEP_STEPS
    warm = 1 if quick else STEP_WARMUP
    data = shakespeare_dataset(args.shakespeare)
    payload: dict = {"tokens_per_rank": TOKENS, "experts": E, "top_k": K, "width": C,
                     "step_model": STEP_MODEL}

    rows, dispatch = [], {}
    for ep in (2, 4):
        r = run_worker(ep, __file__, ["dispatch", str(repeats)], timeout=1800,
                       retries=1)  # it hosts torch's gloo baseline
        ratio = statistics.median(r["torch"]) / statistics.median(r["hpctrain"])
        dispatch[str(ep)] = {**r, "speedup": ratio}
        rows.append([ep, fmt_spread(r["hpctrain"], 1e3), fmt_spread(r["torch"], 1e3),
                     f"{ratio:.2f}x", "yes" if ratio >= GOAL_DISPATCH else "NO"])
    print_table(f"A. dispatch + combine, {TOKENS} tokens x top-{K} of {E} experts, width "
                f"{C}, per rank (ms)", ["ep", "hpctrain (MPI)", "torch (gloo)",
                                        "speedup", f">= {GOAL_DISPATCH}x"], rows)
    payload["dispatch"] = dispatch

    rows, step = [], {}
    for ep in (2, 4):
        ours = run_worker(ep, __file__, ["step", str(data), "hpctrain", str(step_steps)],
                          timeout=3600)
        ddp = run_worker(ep, __file__, ["step", str(data), "ddp", str(step_steps)],
                         timeout=3600, retries=1)
        tok = {name: [r["tokens_per_step"] / t for t in r["step_s"][warm:]]
               for name, r in (("hpctrain", ours), ("ddp", ddp))}
        ratio = statistics.median(tok["hpctrain"]) / statistics.median(tok["ddp"])
        step[str(ep)] = {"hpctrain": ours, "ddp": ddp, "tokens_per_s_ratio": ratio,
                         "params_ratio": ours["params_per_rank"] / ddp["params_per_rank"]}
        rows.append([ep, fmt_spread(tok["hpctrain"]), fmt_spread(tok["ddp"]),
                     f"{ratio:.2f}x", f"{ours['params_per_rank']:,}",
                     f"{ddp['params_per_rank']:,}"])
    print_table("B. training step, tokens/s (median [min, max]) and parameters per rank",
                ["ep", "hpctrain ep", "torch DDP", "ratio", "params/rank ep",
                 "params/rank DDP"], rows)
    payload["step"] = step

    steps = QUICK["balance_steps"] if quick else BALANCE_STEPS
    print(f"C. load balance after {steps} steps of tiny Shakespeare (1 process)", flush=True)
    payload["balance"] = {"steps": steps, "tail": BALANCE_TAIL,
                          "by_coefficient": load_balance(data, steps)}

    g = grouped_vs_loop(repeats)
    ratio = statistics.median(g["loop"]) / statistics.median(g["grouped"])
    print_table(f"D. {E} experts' forward + backward, {GROUPED_TOKENS} copies (ms)",
                ["grouped_mm", "loop", "loop / grouped"],
                [[fmt_spread(g["grouped"], 1e3), fmt_spread(g["loop"], 1e3),
                  f"{ratio:.2f}x"]])
    payload["grouped"] = {**g, "loop_over_grouped": ratio}
    write_result("moe", payload, smoke=quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker and rest[0] == "dispatch":
        worker_dispatch(out, int(rest[1]))
    elif is_worker:
        worker_step(out, Path(rest[1]), rest[2], int(rest[3]))
    else:
        main(sys.argv[1:])
