"""Tensor parallelism: memory per rank against the formulas, step time against torch's
own tensor parallelism, and the largest model under a memory cap.

In one run:
  A. per rank, at tp = 1, 2, 4 (one tensor-parallel group, no data parallelism), GPT-2
     6L/8H/256, 8 rows of 128 tokens:
     - model state (fp32 parameters, gradients and AdamW's two moments: 16 bytes per
       element this rank holds), against 16 (P_split / tp + P_whole), where P_split
       counts the elements tensor parallelism splits (the four linear weights of each
       block, c_attn and c_fc biases, the embedding) and P_whole the rest (norms,
       positions, the output projections' biases);
     - activations: the bytes the blocks keep for backward (unique storages saved by
       autograd inside the blocks, parameters excluded), against the count of the
       tensors each block keeps, per token: outside the tensor-parallel regions the two
       norms' inputs and outputs (4C), inside them q, k, v, the attention output (which
       is also the output projection's input), the MLP's hidden pre- and post-activation
       (12C), plus the norms' statistics and attention's log-sum-exp. Without sequence
       parallelism 4C + 12C / tp; with it 16C / tp.
  B. step time at tp = 2 and 4 against torch.distributed.tensor.parallel
     (``ColwiseParallel`` on c_attn and c_fc, ``RowwiseParallel`` on the output
     projections, over gloo) on the same model, weights, batches and ranks: a bare
     training loop each (forward, backward, AdamW), ROUNDS rounds alternating, the
     median over the steps of the slowest rank. The fused c_attn / c_fc weights are
     permuted before torch splits them so that each rank's rows are its heads' q, k, v
     (gate and up), which is what our layout holds: both compute the same model. The
     embedding and head stay whole on torch's side (a 65-token vocabulary: well under
     1% of the step); ours splits them.
  C. the largest GPT (16 layers, width 64-1024 in steps of 64) that trains two steps on
     4 ranks while every rank's peak resident memory grows by at most CAP_MIB: plain data
     parallelism against tp=2 x dp=2 with ZeRO-3, sequence parallelism and recomputation
     (as bench_zero.py measures, one run per width, binary search), for two global
     batches (CAP_BATCHES): 8 rows of 128 tokens, where model state dominates data
     parallelism's memory (4 ranks can divide it by 4 at most), and 16 rows of 256
     tokens, where activations are as large as the state (what recomputation and
     sequence parallelism remove).

    python perf/bench_tp.py --shakespeare PATH [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.bench_zero import _rss_kib, _warm_up_libraries, slowest_rank_ms  # noqa: E402
from perf.common import (bench_parser, fmt, fmt_spread, init_gloo,  # noqa: E402
                         largest_that_fits, print_table, run_worker, scratch_dir, shakespeare_dataset,
                         worker_args, write_result)
from hpctrain.sizes import MiB  # noqa: E402

MODEL = {"n_layer": 6, "n_head": 8, "n_embd": 256, "block_size": 128}
ROWS = 8
STEPS, WARMUP, ROUNDS = 12, 4, 3
CAP_MIB = 256
CAP_LAYERS, CAP_HEAD_SIZE = 16, 32
CAP_BATCHES = ((8, 128), (16, 256))  # (rows, tokens per row) per step
CAP_WIDTHS = list(range(64, 1025, 64))


def _gpt_config(vocab: int):
    from hpctrain.model.shape import GPTConfig

    return GPTConfig(vocab_size=vocab, vocab_multiple=8, **MODEL)


def _batches(vocab: int, steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    T = MODEL["block_size"]
    return [torch.randint(0, vocab, (ROWS, T + 1), generator=g) for _ in range(steps)]


def _our_model(comm, sequence_parallel: bool):
    import torch

    from hpctrain.comm.world import World
    from hpctrain.model.gpt import GPT
    from hpctrain.parallel.tensor.apply import tensor_parallelize
    from hpctrain.parallel.tensor.group import TensorParallelGroup

    torch.manual_seed(0)
    gpt = GPT(_gpt_config(65))
    group = TensorParallelGroup(comm, World.create(comm, device="cpu"))
    return tensor_parallelize(gpt, group, sequence_parallel=sequence_parallel)


def _torch_model(comm):
    """The same GPT split by torch.distributed.tensor.parallel over gloo."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from hpctrain.model.gpt import GPT
    from hpctrain.parallel.tensor.layout import shard, shard_spec

    init_gloo(comm)
    tp = comm.size
    torch.manual_seed(0)
    gpt = GPT(_gpt_config(65))
    mesh = init_device_mesh("cpu", (tp,))
    for i, block in enumerate(gpt.h):
        for name, linear in (("attn.c_attn", block.attn.c_attn), ("mlp.c_fc", block.mlp.c_fc)):
            for kind in ("weight", "bias"):
                p = getattr(linear, kind)
                if p is None:
                    continue
                spec = shard_spec(f"h.{i}.{name}.{kind}", gpt.cfg)
                with torch.no_grad():  # rank r's rows of torch's split = our slice r
                    p.copy_(torch.cat([shard(p, spec, r, tp) for r in range(tp)]))
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(),
                                         "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(),
                                         "mlp.c_proj": RowwiseParallel()})
        block.attn.widths = [w // tp for w in block.attn.widths]
    return gpt


def _step_times(model, steps: int) -> list[float]:
    """A bare training loop; one multi-tensor AdamW over the split parameters (torch's
    DTensors) and one over the others, as foreach kernels cannot mix the two."""
    import torch
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    kinds = [[p for p in params if isinstance(p, DTensor)],
             [p for p in params if not isinstance(p, DTensor)]]
    opts = [torch.optim.AdamW(group, lr=1e-4, foreach=True) for group in kinds if group]
    times = []
    for tokens in _batches(65, steps):
        t0 = time.perf_counter()
        loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def worker_speed(out: Path, kind: str, sequence_parallel: bool) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    model = _torch_model(comm) if kind == "torch" else _our_model(comm, sequence_parallel)
    times = comm.gather(_step_times(model, STEPS)[WARMUP:], root=0)
    if kind == "torch":
        from hpctrain.comm import device_collectives

        device_collectives.stop()
    if comm.rank == 0:
        step_ms = slowest_rank_ms(times)
        out.write_text(json.dumps({"step_ms": statistics.median(step_ms),
                                   "step_ms_all": step_ms}))


def _saved_block_bytes(model, tokens) -> int:
    """Bytes of the unique storages autograd saves inside the blocks in one forward."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    for block in model.h:
        block.register_forward_pre_hook(lambda *_: hooks.__enter__())
        block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()).backward()
    return sum(seen.values())


def worker_memory(out: Path, sequence_parallel: bool) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    model = _our_model(comm, sequence_parallel)
    elements = sum(p.numel() for p in model.parameters())
    saved = _saved_block_bytes(model, _batches(65, 1)[0])
    per_rank = comm.gather({"elements": elements, "activation_bytes": saved}, root=0)
    if comm.rank == 0:
        out.write_text(json.dumps({"ranks": per_rank}))


def activation_formula(tp: int, sequence_parallel: bool) -> float:
    """Bytes the blocks keep per forward (fp32), from the tensors listed in part A."""
    C, L, T, nh = MODEL["n_embd"], MODEL["n_layer"], MODEL["block_size"], MODEL["n_head"]
    tokens = ROWS * T
    outside = 4 * C + 4  # norm inputs and outputs, their mean and 1/std
    inside = 12 * C + nh  # attention and MLP tensors, attention's log-sum-exp
    per_token = (outside + inside) / tp if sequence_parallel else outside + inside / tp
    return 4.0 * per_token * tokens * L


def split_and_whole_elements() -> tuple[int, int]:
    """Elements of the parameters tensor parallelism splits, and of the others."""
    import torch

    from hpctrain.model.gpt import GPT
    from hpctrain.parallel.tensor.layout import shard_spec

    cfg = _gpt_config(65)
    with torch.device("meta"):
        named = list(GPT(cfg).named_parameters())
    split = sum(p.numel() for n, p in named if shard_spec(n, cfg) is not None)
    return split, sum(p.numel() for _, p in named) - split


def part_memory(quick: bool) -> tuple[list[dict], list[list]]:
    records, rows = [], []
    split, whole = split_and_whole_elements()
    for tp in (1, 2, 4):
        for sp in ((False,) if tp == 1 else (False, True)):
            r = run_worker(tp, __file__, ["memory", str(sp)])["ranks"][0]
            state = 16 * r["elements"]
            state_formula = 16 * (split / tp + whole)
            act_formula = activation_formula(tp, sp)
            rec = {"tp": tp, "sequence_parallel": sp, **r, "model_state_bytes": state,
                   "model_state_formula": state_formula,
                   "activation_formula": act_formula,
                   "activation_vs_formula": r["activation_bytes"] / act_formula}
            records.append(rec)
            rows.append([tp, "yes" if sp else "no", state / MiB, state_formula / MiB,
                         r["activation_bytes"] / MiB, act_formula / MiB,
                         rec["activation_vs_formula"]])
            print(f"  tp={tp} sp={sp}: state {state / MiB:.2f} MiB, activations "
                  f"{r['activation_bytes'] / MiB:.2f} MiB (formula "
                  f"{act_formula / MiB:.2f})", flush=True)
    return records, rows


def part_vs_torch(quick: bool) -> list[dict]:
    out = []
    for tp in (2, 4):
        jobs = {"hpctrain": ["speed", "ours", "False"],
                "hpctrain_sp": ["speed", "ours", "True"],
                "torch": ["speed", "torch", "False"]}
        all_ms = {k: [] for k in jobs}
        for _ in range(1 if quick else ROUNDS):
            for name, args in jobs.items():
                retries = 1 if name == "torch" else 0
                all_ms[name].append(run_worker(tp, __file__, args, retries=retries)["step_ms"])
        med = {k: statistics.median(v) for k, v in all_ms.items()}
        out.append({"tp": tp, "median_ms": med, "all_ms": all_ms,
                    "speedup": med["torch"] / med["hpctrain"],
                    "speedup_sp": med["torch"] / med["hpctrain_sp"]})
        print(f"  tp={tp}: ours {fmt_spread(all_ms['hpctrain'])} ms, with sequence "
              f"parallelism {fmt_spread(all_ms['hpctrain_sp'])}, torch "
              f"{fmt_spread(all_ms['torch'])}", flush=True)
    return out


def worker_train_peak(out: Path, args: list[str]) -> None:
    from mpi4py import MPI

    from hpctrain.comm.world import World
    from hpctrain.config import load_config
    from hpctrain.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    cfg = load_config("shakespeare-char", [*args, f"--train.out_dir={scratch_dir('tp', comm)}"])
    world = World.create(comm, device="cpu")
    _warm_up_libraries()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM)
    base = _rss_kib("VmRSS")
    trainer = Trainer(cfg, world, verbose=False)
    trainer.fit()
    growth = comm.gather((_rss_kib("VmHWM") - base) * 1024, root=0)
    n_params = sum(p.numel() for p in trainer.model.parameters()) * cfg.parallel.tp
    if comm.rank == 0:
        out.write_text(json.dumps({"params": n_params, "peak_rss_growth": max(growth)}))


CAPACITY_LAYOUTS = {
    "data parallel": ["--comm.transport=mpi"],
    "tp=2 x ZeRO-3 x recompute": ["--parallel.tp=2", "--parallel.zero=3",
                                  "--parallel.sequence_parallel=true",
                                  "--model.recompute=block"]}


def _fits(data, width: int, layout: str, rows: int, block: int) -> tuple[bool, dict]:
    args = ["train-peak", f"--data.path={data}", f"--model.n_layer={CAP_LAYERS}",
            f"--model.n_head={width // CAP_HEAD_SIZE}", f"--model.n_embd={width}",
            f"--model.block_size={block}", f"--train.batch_size={rows}",
            "--train.max_iters=2", "--data.verify=false", "--train.eval_interval=0",
            "--train.final_eval=false", "--train.save_checkpoint=false",
            "--train.sample_tokens=0", "--train.progress=false", "--train.log_interval=2",
            *CAPACITY_LAYOUTS[layout]]
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
    r = run_worker(4, __file__, args, env=env, timeout=900)
    return r["peak_rss_growth"] <= CAP_MIB * MiB, r


def part_capacity(data) -> list[dict]:
    """Per batch, the largest model of each layout and the ratio of their parameters."""
    out = []
    for rows, block in CAP_BATCHES:
        found = {layout: largest_that_fits(
            f"{layout}, {rows} x {block} tokens", CAP_WIDTHS,
            lambda width, layout=layout: _fits(data, width, layout, rows, block))
            for layout in CAPACITY_LAYOUTS}
        base, best = found["data parallel"], found["tp=2 x ZeRO-3 x recompute"]
        out.append({"rows": rows, "block": block, "by_layout": found,
                    "ratio": best["params"] / base["params"] if base and best else None})
    return out


def main(argv: list[str]) -> None:
    args = bench_parser(__doc__, shakespeare=True).parse_args(argv)
    quick = args.quick
    data = shakespeare_dataset(args.shakespeare)
    print("A. memory per rank (GPT-2 6L/8H/256, 8 rows of 128 tokens)", flush=True)
    memory, rows = part_memory(quick)
    print_table("Per-rank model state and block activations (MiB) against the formulas",
                ["tp", "seq. parallel", "state", "formula", "activations", "formula",
                 "ratio"], rows)
    print("\nB. step time against torch.distributed.tensor.parallel (gloo)", flush=True)
    speed = part_vs_torch(quick)
    print_table("Step time (ms), median [min, max] over rounds; speedup = torch / ours",
                ["tp", "ours", "ours + seq. parallel", "torch TP", "speedup"],
                [[r["tp"], fmt_spread(r["all_ms"]["hpctrain"]),
                  fmt_spread(r["all_ms"]["hpctrain_sp"]), fmt_spread(r["all_ms"]["torch"]),
                  r["speedup"]] for r in speed])
    capacity = []
    if not quick:
        print(f"\nC. largest model training on 4 ranks under {CAP_MIB} MiB per rank",
              flush=True)
        capacity = part_capacity(data)
        print_table(f"Largest GPT ({CAP_LAYERS} layers) under {CAP_MIB} MiB peak RSS growth "
                    "per rank, 4 ranks", ["batch", "layout", "width", "params", "peak MiB"],
                    [[f"{b['rows']} x {b['block']}", k, c["width"], c["params"],
                      c["peak_rss_growth"] / MiB]
                     for b in capacity for k, c in b["by_layout"].items() if c])
    worst = max(abs(r["activation_vs_formula"] - 1) for r in memory)
    print(f"\nactivations within 10% of the formula: worst {fmt(worst)} -> "
          f"{'MET' if worst <= 0.10 else 'NOT MET'}")
    for r in speed:
        print(f"tp={r['tp']}: >= 1.2x torch TP: {fmt(r['speedup'])}x -> "
              f"{'MET' if r['speedup'] >= 1.2 else 'NOT MET'}")
    for b in capacity:
        if b["ratio"] is not None:
            print(f"{b['rows']} x {b['block']} tokens: >= 6x the parameters of data "
                  f"parallelism under the cap: {fmt(b['ratio'])}x -> "
                  f"{'MET' if b['ratio'] >= 6 else 'NOT MET'}")
    write_result("tp", {"quick": quick, "model": MODEL, "rows": ROWS, "memory": memory,
                        "vs_torch_tp": speed,
                        "capacity": {"cap_mib": CAP_MIB, "batches": capacity}}, smoke=quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        kind, args = rest[0], rest[1:]
        if kind == "speed":
            worker_speed(out, args[0], args[1] == "True")
        elif kind == "memory":
            worker_memory(out, args[0] == "True")
        else:
            worker_train_peak(out, args)
    else:
        main(rest)
