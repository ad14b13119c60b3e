"""A single-process nanoGPT-style training loop: the anchor the benchmarks compare with.

It follows nanoGPT's train.py (no MPI, no buckets): random windows drawn with
``torch.randint``, AdamW with decay/no-decay groups, warm-up + cosine schedule, clipping,
and ``estimate_loss`` on train *and* val every ``eval_interval`` steps (its behaviour).
It uses hpctrain's GPT class, which is nanoGPT's architecture, so only the loop differs.

Three choices can be switched to hpctrain's, so that a comparison isolates the rest:
``--optimizer hpctrain`` (``build_optimizer``: the fused AdamW kernel; nanoGPT's default
on CPU is the per-tensor loop), ``--sampler hpctrain`` (the recipe's ``make_sampler``:
the global batch of step s is ``global_starts(s)``, as every rank of hpctrain reads its
share of it) and ``--eval hpctrain`` (the trainer's periodic estimate: val only, on the
fixed windows of its eval sampler, at steps 250, 500, ...). With all three and the same
seed, the run computes what ``hpctrain train`` computes (same initial weights, same
batches, same updates), in one process.

The seed sets the initial weights and the data order in every mode (``torch.randint``
draws from the generator the model was initialised from; the sampler is seeded).

    OMP_NUM_THREADS=2 python perf/nanogpt_baseline.py --data datasets/shakespeare-char.h5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.config import load_config  # noqa: E402
from hpctrain.data.dataset import TokenDataset  # noqa: E402
from hpctrain.data.sampler import EVAL_STREAM, all_windows, make_sampler  # noqa: E402
from hpctrain.model.gpt import GPT  # noqa: E402
from hpctrain.parallel.optim import build_optimizer, param_groups  # noqa: E402

CHOICES = ("nanogpt", "hpctrain")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--recipe", default="shakespeare-char")
    ap.add_argument("--max-iters", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--model", default="", help="n_layer,n_head,n_embd,block_size override")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--full-val", action="store_true", help="whole-split val loss at the end "
                                                            "(outside the timed part)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--optimizer", choices=CHOICES, default="nanogpt",
                    help="nanoGPT's AdamW (per-tensor loop on CPU) or hpctrain's (fused)")
    ap.add_argument("--sampler", choices=CHOICES, default="nanogpt",
                    help="torch.randint windows or hpctrain's make_sampler (the recipe's)")
    ap.add_argument("--eval", choices=CHOICES, default="nanogpt",
                    help="train + val estimates from step 0, or hpctrain's val estimates")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg = load_config(a.recipe)
    m, o, t = cfg.model, cfg.optim, cfg.train
    if a.model:
        shape = dict(zip(("n_layer", "n_head", "n_embd", "block_size"),
                         map(int, a.model.split(","))))
        m = dataclasses.replace(m, **shape)
    block = m.block_size
    max_iters = a.max_iters or t.max_iters
    batch = a.batch_size or t.batch_size
    ds = TokenDataset(a.data)

    def whole(split):  # nanoGPT keeps the whole token array in memory
        n = ds.splits[split].n_tokens
        return torch.from_numpy(ds.read(split, np.array([0]), n)[0].astype("int64"))

    train, val = whole("train"), whole("val")

    def windows(data, ix):
        x = torch.stack([data[i:i + block] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
        return x, y

    def get_batch(split):
        data = train if split == "train" else val
        return windows(data, torch.randint(len(data) - block, (batch,)))

    seed = t.seed if a.seed is None else a.seed
    sampler = make_sampler(cfg.data.sampler, len(train), block, batch, seed)
    eval_sampler = make_sampler("random", len(val), block, batch, seed, stream=EVAL_STREAM)

    def train_batch(it):
        if a.sampler == "hpctrain":
            return windows(train, sampler.global_starts(it).tolist())
        return get_batch("train")

    torch.manual_seed(seed)
    model = GPT(m.to_gpt(ds.vocab_size))
    params = list(model.parameters())
    init_checksum = float(sum(p.detach().double().sum() for p in params))
    if a.optimizer == "hpctrain":
        opt = build_optimizer(param_groups(model, o.weight_decay), o)
    else:  # nanoGPT: fused only on CUDA, so the default (per-tensor) kernel here
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2))
    decay_iters = o.lr_decay_iters or max_iters

    def get_lr(it):
        if it < o.warmup_iters:
            return o.lr * (it + 1) / (o.warmup_iters + 1)
        if it > decay_iters:
            return o.min_lr
        ratio = (it - o.warmup_iters) / (decay_iters - o.warmup_iters)
        return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (o.lr - o.min_lr)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        if a.eval == "hpctrain":
            out["val"] = sum(model(*windows(val, eval_sampler.global_starts(k).tolist())).item()
                             for k in range(t.eval_iters)) / t.eval_iters
        else:
            for split in ("train", "val"):
                out[split] = sum(model(*get_batch(split)).item()
                                 for _ in range(t.eval_iters)) / t.eval_iters
        model.train()
        return out

    def eval_due(it):
        if a.no_eval or not t.eval_interval or it % t.eval_interval:
            return False
        return it > 0 if a.eval == "hpctrain" else True  # hpctrain: after steps, not at 0

    step_times, evals, losses = [], {}, []
    first_batch = None
    t_start = time.perf_counter()
    for it in range(max_iters + 1):
        if eval_due(it):
            evals[it] = estimate_loss()
        if it == max_iters:
            break
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = get_lr(it)
        x, y = train_batch(it)
        if first_batch is None:  # a fingerprint of step 0's batch (data-order check)
            first_batch = zlib.crc32(x.numpy().tobytes())
        loss = model(x, y)
        losses.append(loss.detach())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - t_start
    result = {"max_iters": max_iters, "batch_size": batch, "block_size": block,
              "threads": torch.get_num_threads(), "seed": seed, "optimizer": a.optimizer,
              "sampler": a.sampler, "eval": a.eval, "loop_s": loop_s,
              "init_checksum": init_checksum, "first_batch_crc32": first_batch,
              "loss_step10": float(losses[9]) if len(losses) >= 10 else None,
              "step_ms_median": 1e3 * statistics.median(step_times[5:] or step_times),
              "evals": evals}
    if a.full_val:
        t_full = time.perf_counter()
        model.eval()
        with torch.no_grad():
            starts = all_windows(len(val), block)
            total = 0.0
            for i in range(0, len(starts), 64):
                s = torch.from_numpy(starts[i:i + 64])
                x = torch.stack([val[j:j + block] for j in s])
                y = torch.stack([val[j + 1:j + 1 + block] for j in s])
                total += model(x, y).item() * y.numel()
            result["full_val_loss"] = total / (len(starts) * block)
        result["full_val_s"] = time.perf_counter() - t_full
    if a.out:
        Path(a.out).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "evals"}))
    return result


if __name__ == "__main__":
    main()
