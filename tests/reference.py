"""The single-process reference: a plain PyTorch loop that shares nothing with hpctrain's
parallel code (no buckets, no hooks, no MPI), only the model, the data and the sampler."""

from __future__ import annotations

import copy
import math

import torch

from hpctrain.config import Config
from hpctrain.data.dataset import TokenDataset
from hpctrain.data.sampler import make_sampler
from hpctrain.model.gpt import GPT, GPTConfig


def plain_lr(step: int, cfg: Config) -> float:
    o, t = cfg.optim, cfg.train
    if step < o.warmup_iters:
        return o.lr * (step + 1) / (o.warmup_iters + 1)
    total = o.lr_decay_iters or t.max_iters
    if step >= total:
        return o.min_lr
    ratio = (step - o.warmup_iters) / max(1, total - o.warmup_iters)
    return o.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (o.lr - o.min_lr)


def plain_torch_run(cfg: Config) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``cfg`` on one process with the whole global batch; return losses and params.

    With ``train.dtype=bf16`` this is textbook mixed precision: a bf16 copy of the fp32
    master model computes forward and backward, its gradients are up-cast onto the
    master, which is clipped and updated in fp32."""
    ds = TokenDataset(cfg.data.path)
    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    model = GPT(GPTConfig(vocab_size=m.vocab_size or ds.vocab_size, block_size=m.block_size,
                          n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                          dropout=m.dropout, bias=m.bias))
    params = list(model.parameters())
    compute = model
    if cfg.train.dtype == "bf16":
        compute = copy.deepcopy(model).to(torch.bfloat16)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                            eps=cfg.optim.eps, foreach=False)
    sampler = make_sampler(cfg.data.sampler, ds.splits["train"].n_tokens, m.block_size,
                           cfg.train.batch_size, cfg.train.seed)
    losses = []
    for step in range(cfg.train.max_iters):
        for g in opt.param_groups:
            g["lr"] = plain_lr(step, cfg)
        tokens = torch.from_numpy(ds.read("train", sampler.global_starts(step), m.block_size + 1))
        if compute is not model:
            with torch.no_grad():
                for low, p in zip(compute.parameters(), params):
                    low.copy_(p)
        loss = compute(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        if compute is not model:
            for low, p in zip(compute.parameters(), params):
                p.grad, low.grad = low.grad.float(), None
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
