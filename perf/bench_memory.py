"""Peak memory of one rank training a GPT-2-medium-shaped model (MPT-350M's shape: 24
layers, width 1024, 16 heads, GPT-2's 50,257-token vocabulary, 2,048-token sequences),
against the performance model's formula and against a plain torch GPT of the same shape.

Three variants, each in a fresh process, fp32, AdamW, one micro-batch of ROWS sequences:

  reference   a straightforward ``nn.Module`` GPT written here (embedding, pre-norm blocks
              with ``scaled_dot_product_attention``, a tied head, ``F.cross_entropy`` on
              the full fp32 logits): what a user's own torch script keeps;
  whole       hpctrain's GPT with ``--model.loss_chunk=-1`` (the whole head at once);
  default     hpctrain's GPT as it comes (``loss_chunk=0``: the automatic rule chunks the
              head when a micro-batch's fp32 logits pass 256 MiB; 2,048 tokens of GPT-2's
              vocabulary take 393 MiB, so it chunks, 1,335 tokens at a time).

What a rank holds: the model state (parameters, gradients, Adam's two moments: 16 bytes a
parameter in fp32) and, during the step, the activations and the head's logits. Both are
measured from the kernel's count of the process's resident pages (``ru_maxrss`` after
``/proc/self/clear_refs`` resets the mark, as ``bench_long_context.py`` explains: torch
keeps no peak statistic for CPU memory, and glibc is told to map every block over 1 MiB
on its own so a freed tensor leaves the resident set at once):

  state       the resident growth from before the model is built to after a warm-up step
              at WARMUP_T tokens (the parameters, the gradients, Adam's moments, and the
              kernels torch loads on first use);
  step peak   the peak growth of the full-size forward and backward over the resident
              size after the warm-up (the gradients' buffers exist already: state);
  optimizer   the same for the optimizer step that follows (AdamW, one parameter at a
              time: a few temporaries of the largest parameter);
  peak        state + the larger of the two: the rank's peak over a bare interpreter with
              torch loaded.

The formula: ``zero_formula(0, "fp32", 1)`` bytes a parameter for the state;
``activation_bytes_per_layer`` (Korthikanti et al.'s 34 s b h in 16 bits, doubled for
fp32, flash attention: torch's CPU ``scaled_dot_product_attention`` keeps no s x s
scores) times the layers, and ``logits_bytes`` (the head as the variant runs it) for the
step. The ratios compare each variant with the reference and with its formula.

This machine (24 GB shared by five processes) holds the full 24 layers at one sequence
(ROWS = 1), not llm-foundry's published micro-batch for MPT-350M (8 sequences of 2,048,
``scripts/train/yamls/pretrain/mpt-350m.yaml``); the JSON also gives the formula's logits
term at 8 sequences, whole and automatic, where it matters most.

    python perf/bench_memory.py [--quick]
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (bench_parser, fmt, print_table, run_worker,  # noqa: E402
                         worker_args, write_result)
from hpctrain.sizes import GiB  # noqa: E402

SHAPE = dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, block_size=2048)
QUICK_SHAPE = dict(SHAPE, n_layer=2)
ROWS = 1
PUBLISHED_ROWS = 8  # llm-foundry's device_train_microbatch_size for MPT-350M
VARIANTS = {"reference": None, "whole": -1, "default": 0}  # name -> hpctrain loss_chunk
WARMUP_T = 64
THREADS = 2
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}


# --------------------------------------------------------------------------- worker

def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not in /proc/self/status")


def reference_gpt(shape: dict):
    """A plain torch GPT-2 of ``shape``: no chunking, no hooks, the cross-entropy on the
    whole (B, T, V) logits."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    C, H = shape["n_embd"], shape["n_head"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C, bias=False), nn.LayerNorm(C, bias=False)
            self.qkv, self.proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
            self.fc, self.out = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2)
                       for t in self.qkv(self.ln1(x)).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(shape["vocab_size"], C)
            self.wpe = nn.Embedding(shape["block_size"], C)
            self.h = nn.ModuleList(Block() for _ in range(shape["n_layer"]))
            self.ln_f = nn.LayerNorm(C, bias=False)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
            for block in self.h:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head, (B, T, V)
            return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    return GPT()


def worker(out: Path, variant: str, shape: dict, rows: int) -> None:
    import torch

    from hpctrain.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    torch.ones(8, 8, requires_grad=True).sum().backward()  # autograd's engine started
    start = _rss_bytes()
    chunk = VARIANTS[variant]
    model = reference_gpt(shape) if chunk is None else GPT(GPTConfig(**shape, loss_chunk=chunk))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    gen = torch.Generator().manual_seed(1)
    seen = []
    if chunk is not None:  # which chunk the head ran with (0: all at once)
        model.register_forward_hook(
            lambda m, args, out: seen.append(m.cfg.head_chunk(args[1].numel())))

    def peak_of(fn) -> tuple[int, float]:
        """The peak resident growth while ``fn`` runs, over the size before; seconds."""
        before = _rss_bytes()
        Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark := the RSS now
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, took

    def forward_backward(b: int, t: int) -> None:
        x, y = torch.randint(0, shape["vocab_size"], (2, b, t), generator=gen)
        model(x, y).backward()

    def optimizer_step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay: model state

    forward_backward(1, WARMUP_T)
    optimizer_step()
    base = _rss_bytes()
    step_peak, took = peak_of(lambda: forward_backward(rows, shape["block_size"]))
    opt_peak, _ = peak_of(optimizer_step)
    out.write_text(json.dumps({
        "variant": variant, "loss_chunk": chunk, "params": params,
        "head_chunk": seen[-1] if seen else None,
        "state_bytes": base - start, "step_peak_bytes": step_peak,
        "optimizer_peak_bytes": opt_peak,
        "peak_bytes": base - start + max(step_peak, opt_peak), "step_s": took}))


# --------------------------------------------------------------------------- driver

def formula(shape: dict, rows: int, loss_chunk: int, params: int) -> dict:
    from hpctrain.parallel.memory import zero_formula
    from hpctrain.scaling.activations import activation_bytes_per_layer, logits_bytes
    from hpctrain.scaling.models import ModelShape

    ms = ModelShape(shape["n_layer"], shape["n_head"], shape["n_embd"], shape["block_size"],
                    shape["vocab_size"])
    acts = shape["n_layer"] * activation_bytes_per_layer(ms, rows, "fp32", True)
    logits = logits_bytes(ms, rows * shape["block_size"], loss_chunk)
    state = zero_formula(0, "fp32", 1) * params
    return {"state_bytes": state, "activation_bytes": acts, "logits_bytes": logits,
            "step_bytes": acts + logits, "peak_bytes": state + acts + logits}


def published_logits(shape: dict) -> dict:
    """The formula's logits term at llm-foundry's micro-batch: whole and automatic."""
    from hpctrain.scaling.activations import logits_bytes
    from hpctrain.scaling.models import ModelShape

    ms = ModelShape(shape["n_layer"], shape["n_head"], shape["n_embd"], shape["block_size"],
                    shape["vocab_size"])
    tokens = PUBLISHED_ROWS * shape["block_size"]
    return {"rows": PUBLISHED_ROWS, "tokens": tokens,
            "whole_bytes": logits_bytes(ms, tokens, -1),
            "default_bytes": logits_bytes(ms, tokens, 0)}


def main(argv: list[str]) -> None:
    args = bench_parser(__doc__).parse_args(argv)
    shape = QUICK_SHAPE if args.quick else SHAPE
    print(f"GPT-2-medium-shaped: {shape}, {ROWS} row(s), fp32, AdamW, {THREADS} threads",
          flush=True)
    records = []
    for variant in VARIANTS:
        r = run_worker(1, __file__, [variant, json.dumps(shape), str(ROWS)], mpi=False,
                       threads=THREADS, env=MALLOC_ENV, timeout=3600)
        chunk = -1 if r["loss_chunk"] is None else r["loss_chunk"]
        r["formula"] = formula(shape, ROWS, chunk, r["params"])
        records.append(r)
        print(f"  {variant:<10} state {r['state_bytes'] / GiB:6.2f} GiB, step peak "
              f"{r['step_peak_bytes'] / GiB:6.2f} GiB, peak {r['peak_bytes'] / GiB:6.2f} GiB "
              f"(formula {r['formula']['peak_bytes'] / GiB:.2f}); head chunk "
              f"{r['head_chunk']}; step {r['step_s']:.0f} s", flush=True)
    ref = records[0]
    for r in records:
        r["vs_reference"] = r["peak_bytes"] / ref["peak_bytes"]
        r["step_vs_reference"] = r["step_peak_bytes"] / ref["step_peak_bytes"]
        r["vs_formula"] = r["peak_bytes"] / r["formula"]["peak_bytes"]
        r["step_vs_formula"] = r["step_peak_bytes"] / r["formula"]["step_bytes"]
    print_table("Peak memory of one rank (GiB); ratios: this / reference, measured / formula",
                ["variant", "state", "step peak", "peak", "formula peak", "peak / ref",
                 "step / ref", "peak / formula", "step / formula"],
                [[r["variant"], r["state_bytes"] / GiB, r["step_peak_bytes"] / GiB,
                  r["peak_bytes"] / GiB, r["formula"]["peak_bytes"] / GiB, r["vs_reference"],
                  r["step_vs_reference"], r["vs_formula"], r["step_vs_formula"]]
                 for r in records])
    pub = published_logits(shape)
    print(f"\nformula's logits term at llm-foundry's micro-batch ({pub['rows']} x "
          f"{shape['block_size']} tokens): whole {fmt(pub['whole_bytes'] / GiB)} GiB, "
          f"automatic {fmt(pub['default_bytes'] / GiB)} GiB")
    write_result("memory", {"quick": args.quick, "shape": shape, "rows": ROWS, "dtype": "fp32",
                            "threads": THREADS, "warmup_tokens": WARMUP_T,
                            "variants": records, "published": pub}, smoke=args.quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        worker(out, rest[0], json.loads(rest[1]), int(rest[2]))
    else:
        main(sys.argv[1:])
