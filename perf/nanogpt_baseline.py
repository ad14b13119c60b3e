"""A single-process nanoGPT-style training loop: the anchor the benchmarks compare with.

It follows nanoGPT's train.py (no MPI, no buckets): random windows drawn with
``torch.randint``, AdamW with decay/no-decay groups, warm-up + cosine schedule, clipping,
and ``estimate_loss`` on train *and* val every ``eval_interval`` steps (its behaviour).
It uses hpctrain's GPT class, which is nanoGPT's architecture, so only the loop differs.

    OMP_NUM_THREADS=2 python perf/nanogpt_baseline.py --data datasets/shakespeare-char.h5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.config import load_config  # noqa: E402
from hpctrain.data.dataset import TokenDataset  # noqa: E402
from hpctrain.data.sampler import all_windows  # noqa: E402
from hpctrain.model.gpt import GPT, GPTConfig  # noqa: E402


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
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg = load_config(a.recipe)
    m, o, t = cfg.model, cfg.optim, cfg.train
    n_layer, n_head, n_embd, block = m.n_layer, m.n_head, m.n_embd, m.block_size
    if a.model:
        n_layer, n_head, n_embd, block = map(int, a.model.split(","))
    max_iters = a.max_iters or t.max_iters
    batch = a.batch_size or t.batch_size
    ds = TokenDataset(a.data)

    def whole(split):  # nanoGPT keeps the whole token array in memory
        n = ds.splits[split].n_tokens
        return torch.from_numpy(ds.read(split, np.array([0]), n)[0].astype("int64"))

    train, val = whole("train"), whole("val")

    def get_batch(split):
        data = train if split == "train" else val
        ix = torch.randint(len(data) - block, (batch,))
        x = torch.stack([data[i:i + block] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
        return x, y

    torch.manual_seed(t.seed if a.seed is None else a.seed)
    model = GPT(GPTConfig(vocab_size=ds.vocab_size, block_size=block, n_layer=n_layer,
                          n_head=n_head, n_embd=n_embd, dropout=m.dropout, bias=m.bias))
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
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
        for split in ("train", "val"):
            out[split] = sum(model(*get_batch(split)).item() for _ in range(t.eval_iters)) / t.eval_iters
        model.train()
        return out

    step_times, evals = [], {}
    t_start = time.perf_counter()
    for it in range(max_iters + 1):
        if not a.no_eval and t.eval_interval and it % t.eval_interval == 0:
            evals[it] = estimate_loss()
        if it == max_iters:
            break
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = get_lr(it)
        x, y = get_batch("train")
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - t_start
    result = {"max_iters": max_iters, "batch_size": batch, "block_size": block,
              "threads": torch.get_num_threads(), "loop_s": loop_s,
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
