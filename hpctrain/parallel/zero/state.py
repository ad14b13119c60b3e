"""What a ZeRO engine gives a checkpoint and takes back from one.

``state_shards`` hands over this rank's shards bucket by bucket (a sharded checkpoint
of the same layout saves them as they are); ``consolidated_state`` gathers whole
per-parameter tensors on every rank (``final.h5``, export, sampling); ``load_shards``
takes back its own shards and ``load_full_state`` cuts its shards out of whole tensors
(a checkpoint of any other layout, ``--train.init_from``).
"""

from __future__ import annotations

import torch

from hpctrain.comm.watchdog import wait_all
from hpctrain.parallel.engine import STATE_KEYS, BucketShard, EngineState
from hpctrain.parallel.zero.buckets import pack_flat


class ShardedState:
    """Checkpoint state of ``Zero`` (a mixin: it reads the engine's ``model``,
    ``buckets``, ``optimizers``, ``world``, ``level``, ``size``, ``dtype`` and
    ``tensor_split``, and calls its public ``allgather_parameters``)."""

    def consolidated_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full fp32 parameters and Adam moments per parameter, on every rank (collective).

        Keys are the parameters' names in the model; values hold ``param``, ``exp_avg``,
        ``exp_avg_sq`` and ``step``."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for b, opt in zip(self.buckets, self.optimizers):
            full = {}
            for key, shard in (("param", b.master), ("exp_avg", b.exp_avg),
                               ("exp_avg_sq", b.exp_avg_sq)):
                flat = torch.empty(b.layout.padded, dtype=torch.float32, device=shard.device)
                if b.layout.world == 1:
                    flat.copy_(shard)
                else:
                    w = b.world
                    src = w.transport.buffer(shard.contiguous())
                    dst = w.transport.buffer(flat)
                    src.prepare()
                    dst.prepare(send=False)
                    wait_all([w.transport.allgather(dst, src)],
                             timeout=self.world.timeout, what="consolidating ZeRO state")
                    dst.complete()
                full[key] = flat
            step = max((float(s["step"]) for s in opt.state.values()), default=0.0)
            for p, off in zip(b.params, b.layout.offsets):
                out[names[id(p)]] = {k: v[off:off + p.numel()].view(p.shape).clone()
                                     for k, v in full.items()}
                out[names[id(p)]]["step"] = torch.tensor(step)
        return self.tensor_split.whole(out)

    def optimizer_step(self) -> float:
        """Adam's step count (the same in every bucket's optimizer)."""
        return max((float(s["step"]) for opt in self.optimizers for s in opt.state.values()),
                   default=0.0)

    def load_full_state(self, full: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        """Take this rank's shards from whole per-parameter tensors (``param``,
        ``exp_avg``, ``exp_avg_sq`` by name), e.g. a checkpoint from another layout;
        split parameters take this rank's tensor-parallel slice of them."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        full = self.tensor_split.local(full)
        with torch.no_grad():
            for b, opt in zip(self.buckets, self.optimizers):
                lo, hi = b.layout.rank_range(b.rank)
                mine = [full[names[id(p)]] for p in b.params]
                flat = {k: pack_flat(b.layout, [m[k] for m in mine])
                        for k in ("param", "exp_avg", "exp_avg_sq")}
                dev = b.master.device
                b.master.copy_(flat["param"][lo:hi].to(dev))
                b.exp_avg.copy_(flat["exp_avg"][lo:hi].to(dev))
                b.exp_avg_sq.copy_(flat["exp_avg_sq"][lo:hi].to(dev))
                if self.level < 3:  # the compute parameters, whole
                    b.full.copy_(flat["param"].to(dev, self.dtype))
                elif b.shard is not b.master:
                    b.shard.copy_(b.master)
                for s in opt.state.values():
                    s["step"].fill_(step)

    def load_shards(self, shards: list[dict], step: float) -> None:
        """Take back this rank's own shards (``param``, ``exp_avg``, ``exp_avg_sq`` per
        bucket, as ``state_shards`` gave them) and share the parameters (collective)."""
        with torch.no_grad():
            for b, opt, s in zip(self.buckets, self.optimizers, shards):
                dev = b.master.device
                b.master.copy_(torch.from_numpy(s["param"]).to(dev))
                b.exp_avg.copy_(torch.from_numpy(s["exp_avg"]).to(dev))
                b.exp_avg_sq.copy_(torch.from_numpy(s["exp_avg_sq"]).to(dev))
                if self.dtype != torch.float32:
                    b.publish_master()
                for st in opt.state.values():
                    st["step"].fill_(step)
        if self.level < 3 and self.size > 1:
            self.allgather_parameters()

    def state_shards(self) -> EngineState:
        """This rank's shards, bucket by bucket (what a sharded checkpoint saves)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return EngineState(self.state_kind, self.optimizer_step(), buckets=[
            BucketShard([names[id(p)] for p in b.params], [list(p.shape) for p in b.params],
                        b.layout, dict(zip(STATE_KEYS, (b.master, b.exp_avg, b.exp_avg_sq))))
            for b in self.buckets])
