"""The single-process reference: a plain PyTorch loop that shares nothing with hpctrain's
parallel code (no buckets, no hooks, no MPI), only the model, the data and the sampler.

``reference_run`` is the one the tests call: under ``mpiexec`` rank 0 computes it once
and broadcasts it (four ranks on two cores would otherwise train four identical copies),
and with ``HPCTRAIN_REF_CACHE`` set (``make test`` sets it for its legs) a result is kept
on disk under a key made of the configuration and the dataset's tokens, so the 2- and
4-rank legs train each reference once between them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from hpctrain.config import Config
from hpctrain.data.dataset import TokenDataset
from hpctrain.data.sampler import make_sampler
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import WHOLE_HEAD

CACHE_ENV = "HPCTRAIN_REF_CACHE"


@dataclasses.dataclass
class Reference:
    losses: list[float]
    """Mean loss over the whole global batch, one per step."""
    params: dict[str, torch.Tensor]
    """Parameters after the last step, by name."""
    grads: dict[str, torch.Tensor]
    """The first step's gradient of the mean loss by name (fp32, before clipping)."""
    grad_norm: float
    """The global L2 norm of ``grads``."""


def plain_model_config(cfg: Config) -> Config:
    """``cfg`` without activation recomputation (of any kind), the chunked loss
    (automatic or not) or ``torch.compile``: the run those options must reproduce (the
    reference otherwise builds its model as ``cfg`` says)."""
    model = dataclasses.replace(cfg.model, recompute="none", recompute_every=0,
                                loss_chunk=WHOLE_HEAD)
    return dataclasses.replace(cfg, model=model,
                               train=dataclasses.replace(cfg.train, compile=False))


def plain_lr(step: int, cfg: Config) -> float:
    o, t = cfg.optim, cfg.train
    if o.schedule == "constant":
        return o.lr
    if step < o.warmup_iters:
        return o.lr * (step + 1) / (o.warmup_iters + 1)
    total = o.lr_decay_iters or t.max_iters
    if step >= total:
        return o.min_lr
    ratio = (step - o.warmup_iters) / max(1, total - o.warmup_iters)
    return o.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (o.lr - o.min_lr)


def plain_torch_run(cfg: Config, init: dict | None = None) -> Reference:
    """Train ``cfg`` on one process with the whole global batch in one forward pass,
    from ``init`` (parameters by name, as the model's own; ``--train.init_from``'s
    tests) or from the seed's initialization.

    With ``train.dtype=bf16`` this is textbook mixed precision: a bf16 copy of the fp32
    master model computes forward and backward, its gradients are up-cast onto the
    master, which is clipped and updated in fp32."""
    ds = TokenDataset(cfg.data.path)
    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    model = GPT(m.to_gpt(ds.vocab_size))
    if init is not None:
        model.load_parameters(init)
    params = list(model.parameters())
    compute = model
    if cfg.train.dtype == "bf16":
        compute = copy.deepcopy(model).to(torch.bfloat16)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if cfg.optim.name == "sgd":
        opt = torch.optim.SGD(groups, lr=cfg.optim.lr, momentum=0.0, foreach=False)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                eps=cfg.optim.eps, foreach=False)
    sampler = make_sampler(cfg.data.sampler, ds.splits["train"].n_tokens, m.block_size,
                           cfg.train.batch_size, cfg.train.seed)
    losses, first_grads, first_norm = [], {}, 0.0
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
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            first_norm = float(torch.nn.utils.get_total_norm(list(first_grads.values())))
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    ds.close()
    return Reference(losses, {n: p.detach().clone() for n, p in model.named_parameters()},
                     first_grads, first_norm)


def reference_key(cfg: Config) -> str:
    """What the reference reads: the model, optimizer, batch, steps, seed and sampler
    settings (not the parallel layout), and the dataset's tokens (test datasets are
    rebuilt in a new place every run)."""
    full = cfg.to_dict()
    settings = {"model": full["model"], "optim": full["optim"],
                "sampler": full["data"]["sampler"],
                "train": {k: full["train"][k] for k in ("seed", "batch_size", "max_iters", "dtype")}}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    ds = TokenDataset(cfg.data.path)
    for split in ("train", "val"):
        n = ds.splits[split].n_tokens
        digest.update(np.ascontiguousarray(ds.read(split, np.zeros(1, np.int64), n)).tobytes())
    ds.close()
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:32]


_MEMO: dict[str, Reference] = {}


def _computed_or_cached(cfg: Config) -> Reference:
    key = reference_key(cfg)
    if key in _MEMO:
        return _MEMO[key]
    cache = os.environ.get(CACHE_ENV)
    path = Path(cache) / f"{key}.pt" if cache else None
    if path is not None and path.exists():
        ref = Reference(**torch.load(path, weights_only=True))
    else:
        ref = plain_torch_run(cfg)
        if path is not None:  # another leg may read it: publish whole files only
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save(dataclasses.asdict(ref), tmp)
            tmp.replace(path)
    _MEMO[key] = ref
    return ref


def reference_run(cfg: Config, comm=None) -> Reference:
    """The single-process reference of ``cfg``. Collective over ``comm`` (default: every
    rank, when MPI runs with several): rank 0 computes or loads it and broadcasts it."""
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    if comm.size == 1:
        return _computed_or_cached(cfg)
    ref = _computed_or_cached(cfg) if comm.rank == 0 else None
    return comm.bcast(ref, root=0)
