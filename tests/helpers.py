"""Small builders shared by the tests: tiny configs and real token files."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

from hpctrain.comm.local_mpiexec import Launcher, find_launcher
from hpctrain.config import build_config
from hpctrain.data.corpus import stdlib_files
from hpctrain.data.prepare import prepare

REPO = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def launcher() -> Launcher:
    """The MPI launcher the tests start ranks with (``MPIEXEC``, else the venv's mpiexec)."""
    return find_launcher()


def cpu_world(comm=None, **kwargs):
    """``World.create`` on the CPU whatever this node has: what every test that compares
    against the single-process CPU reference builds (``require_pinned_device``)."""
    from hpctrain.comm.world import World

    return World.create(comm, device="cpu", **kwargs)


def require_pinned_device(trainer) -> None:
    """The trainer under comparison computes on a device the test chose: a world built
    with ``auto`` would take a node's GPU and be compared with a CPU reference."""
    setting = trainer.world.device_setting
    assert setting != "auto", ("a test that compares against the CPU reference built its "
                               "World with device='auto': use tests.helpers.cpu_world(comm) "
                               "or name the device it tests (fake)")


def make_dataset(path: Path, max_bytes: int = 300_000, tokenizer: str = "char") -> Path:
    prepare(stdlib_files(max_bytes), path, tokenizer=tokenizer, show_progress=False)
    return Path(path)


def tiny_config(data_path, out_dir, **overrides):
    """A model small enough that its 10 steps take well under a second."""
    recipe = {
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"path": str(data_path)},
        "optim": {"lr": 3e-3, "warmup_iters": 2, "min_lr": 3e-4},
        "train": {"batch_size": 8, "max_iters": 10, "log_interval": 5, "eval_interval": 0,
                  "final_eval": False, "out_dir": str(out_dir), "sample_tokens": 0,
                  "save_checkpoint": False, "progress": False, "threads": 1},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__", 1) if "__" in dotted else dotted.split(".", 1)
        recipe.setdefault(section, {})[key] = value
    return build_config(recipe)


TIMED = "1,1.5,0.7"
"""Pass times F,B,W a zbv order is built for in the MPI tests (tests/test_pass_times.py
checks it differs from the equal-time order at pp = 2 and 4)."""

LLAMA = {"model.arch": "llama", "model.n_kv_head": 1, "model.ffn_hidden": 48,
         "model.tie_embeddings": False, "model.rope_theta": 500.0}
"""``tiny_config`` overrides for a tiny Llama: grouped-query attention, an untied head."""


def random_weights(gpt_cfg, seed: int = 7) -> dict:
    """Parameters for ``GPT(gpt_cfg)`` that no seed's initialization gives: every tensor,
    the norms' ones included, moved by noise; the vocabulary's padded rows stay zero."""
    import torch

    from hpctrain.model.gpt import GPT

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        params = {}
        for name, p in GPT(gpt_cfg).named_parameters():
            t = p.detach() + 0.05 * torch.randn_like(p)
            if name in ("wte.weight", "lm_head.weight"):
                t[gpt_cfg.vocab_size:] = 0
            params[name] = t
    return params


def weights_checkpoint(path, params: dict, gpt_cfg, tokenizer: dict | None = None) -> Path:
    """``params`` (padded as ``gpt_cfg`` says) as the checkpoint ``ckpt import`` writes,
    recorded unpadded (``vocab_multiple=1``), as an import of a published model is."""
    from hpctrain.checkpoint.export import unpadded
    from hpctrain.checkpoint.weights import save_weights

    model = {**gpt_cfg.shape(), "vocab_multiple": 1}
    return save_weights(path, unpadded(params, model), model, tokenizer=tokenizer,
                        note={"from": "test"})


TEXTS = ["def hello(world):\n    return world * 2\n", "class Point:\n    x: int = 0\n",
         "for i in range(10):\n    print(i, 'é')\n"]


def save_tokenizer(directory, vocab_size: int = 300) -> int:
    """A byte-level BPE trained here on ``TEXTS`` (nothing downloaded), saved as
    ``directory/tokenizer.json``; returns its vocabulary size. Skips the test without
    the tokenizers package."""
    import pytest

    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 10, tk.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|end|>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    Path(directory).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(directory) / "tokenizer.json"))
    return tok.get_vocab_size()


def run(cmd: list[str], timeout: float = 120, env: dict | None = None,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run a command under a hard time limit (a hang fails the test, never the suite)."""
    full_env = {**os.environ, **launcher().env(), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd)


def hpctrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpctrain", *args]


def mpiexec(n: int, *cmd: str) -> list[str]:
    """``cmd`` on ``n`` ranks of this machine, with the flags the launcher's MPI needs."""
    return launcher().command(n, *cmd)


def same_on_all_ranks(comm, tensor) -> bool:
    """True when ``tensor`` holds bit-identical values on every rank of ``comm``."""
    import numpy as np
    from mpi4py import MPI

    mine = tensor.detach().double().numpy().ravel()  # a copy, never a view of the storage
    root = comm.bcast(mine if comm.rank == 0 else None, root=0)
    return bool(comm.allreduce(int(np.array_equal(mine, root)), op=MPI.MIN))


# fp32 gradients of the first step against the single-process ones: the ranks sum their
# rows' gradients in another order than one process does over the whole batch, which
# moves the last bits only. Measured over every MPI equivalence test at 2 and 4 ranks:
# at most 4.9e-7 of the largest element of a tensor. An error of scale (a factor of 2,
# a missing division) is a million times larger.
GRAD_RTOL = 1e-6


@dataclasses.dataclass
class FirstStep:
    grads: dict = dataclasses.field(default_factory=dict)
    """This rank's reduced gradients by parameter name (fp32), as the optimizer reads them."""
    norm: float | None = None
    """The global gradient norm the trainer computed (before clipping)."""


def reduced_gradients(trainer) -> dict:
    """The gradient every parameter of this rank's model holds after the reduction, in
    fp32 and whole: ZeRO shards are gathered over the data-parallel ranks, and
    tensor-parallel slices over the tensor-parallel group (collective)."""
    split = trainer.engine.tensor_split
    grads = _local_reduced_gradients(trainer)
    return {n: s["param"] for n, s in split.whole({n: {"param": g}
                                                   for n, g in grads.items()}).items()}


def _local_reduced_gradients(trainer) -> dict:
    import torch

    names = {id(p): n for n, p in trainer.model.named_parameters()}
    engine = trainer.engine
    if engine.state_shards().kind == "replicated":  # whole gradients on every rank
        return {names[id(p)]: p.grad.detach().float().clone()
                for p in trainer.model.parameters()}
    out = {}
    for b in engine.buckets:
        lay = b.layout
        shard = b.grad_shard[:lay.shard].detach().float().contiguous().cpu()
        full = shard
        if lay.world > 1:
            full = torch.empty(lay.padded, dtype=torch.float32)
            b.world.comm.Allgather(shard.numpy(), full.numpy())
        for p, off in zip(b.params, lay.offsets):
            out[names[id(p)]] = full[off:off + p.numel()].view(p.shape).clone()
    return out


def capture_first_step(trainer) -> FirstStep:
    """Record the reduced gradients and the gradient norm of the trainer's first
    optimizer step (taken just before the update)."""
    first = FirstStep()
    original = trainer.engine.step

    def step(lr, clip):
        if first.norm is not None:
            return original(lr, clip)
        first.grads = reduced_gradients(trainer)
        norm = original(lr, clip)
        first.norm = float(norm)
        return norm

    trainer.engine.step = step
    return first


def assert_gradients_match(first: FirstStep, ref, comm=None, rtol: float = GRAD_RTOL) -> None:
    """Every parameter's reduced gradient and the global norm equal the reference's, to
    ``rtol`` of the tensor's largest element; across ``comm`` (the pipeline stages of one
    replica, or every rank) every parameter of the model is covered."""
    assert first.norm is not None, "the trainer took no optimizer step"
    for name, g in first.grads.items():
        want = ref.grads[name]
        err = float((g - want).abs().max())
        scale = float(want.abs().max())
        assert err <= rtol * scale, (f"{name}: reduced gradient differs from the "
                                     f"single-process one by {err:.3g} (largest element "
                                     f"{scale:.3g}, allowed {rtol:g} of it)")
    assert abs(first.norm - ref.grad_norm) <= rtol * ref.grad_norm, (
        f"gradient norm {first.norm!r} != single-process {ref.grad_norm!r}")
    covered = set(first.grads)
    if comm is not None:
        covered = set().union(*comm.allgather(sorted(covered)))
    assert covered == set(ref.grads), f"parameters without a gradient: {set(ref.grads) - covered}"


def fit_against_reference(trainer, cfg, comm=None, *, param_atol: float = 1e-5,
                          loss_atol: float = 1e-5, grad_rtol: float = GRAD_RTOL):
    """Train, then check the first step's reduced gradients and norm, every step's loss
    and the final parameters against the single-process run. Collective over every rank.
    Returns (result, reference)."""
    from mpi4py import MPI

    from tests.reference import reference_run

    require_pinned_device(trainer)
    first = capture_first_step(trainer)
    result = trainer.fit(close=False)  # the checks use the trainer's communicators
    # The gradients first: a wrong one names the parameter, a wrong loss only the step.
    ref = reference_run(cfg)
    replica = trainer.grid.pp_comm if trainer.grid.pp > 1 else None
    assert_gradients_match(first, ref, replica, rtol=grad_rtol)
    assert_matches_reference(trainer, result, cfg, comm, param_atol=param_atol,
                             loss_atol=loss_atol, ref=ref)
    if MPI.COMM_WORLD.size > 1:  # a failed assertion aborts every rank (conftest)
        MPI.COMM_WORLD.Barrier()
    trainer.close()
    return result, ref


def assert_matches_reference(trainer, result, cfg, comm=None, *, param_atol: float = 1e-5,
                             loss_atol: float = 1e-5, ref=None):
    """Per-step losses and final parameters equal the plain single-process loop (1e-5).
    Without ``ref``, collective over every rank (the reference is computed once); returns it."""
    import numpy as np
    import torch

    from tests.reference import reference_run

    require_pinned_device(trainer)
    ref = ref if ref is not None else reference_run(cfg)
    assert len(result.losses) == cfg.train.max_iters
    np.testing.assert_allclose(result.losses, ref.losses, atol=loss_atol, rtol=0)
    with trainer.engine.gathered():
        mine = {n: {"param": p.detach()} for n, p in trainer.model.named_parameters()}
        for name, p in mine.items():
            if comm is not None:
                assert same_on_all_ranks(comm, p["param"]), f"{name} differs between ranks"
        for name, whole in trainer.engine.tensor_split.whole(mine).items():
            torch.testing.assert_close(whole["param"].to(ref.params[name].device),
                                       ref.params[name], atol=param_atol, rtol=0)
    return ref


# bf16 vs the bf16 single-process run (tests/reference.py): the reference makes the whole
# global batch's gradient in one bf16 backward, rounded to bf16 once and up-cast onto its
# fp32 master: it accumulates no micro-batches, so there is nothing in it to move to fp32.
# The engine adds each rank's and micro-batch's bf16 gradient in fp32 (its main
# gradients) and never rounds the sum back; the two round differently (bf16 keeps 8 bits
# of mantissa) and the difference grows over the steps. That the engine's sum is the fp32
# one is checked exactly by test_bf16_micro_batches_accumulate_and_reduce_in_fp32.
# Measured over 20 steps at N = 1, 2, 4: losses within 5.2e-4, master weights within
# 2.3e-3; the bounds leave a 4x margin.
BF16_LOSS_ATOL = 2e-3
BF16_PARAM_ATOL = 1e-2
# The first step's reduced gradient against the bf16 single-process one, relative to each
# tensor's largest element: bf16 rounding (8 mantissa bits) of per-rank against whole-batch
# gradients moves it by up to 0.036 (measured: a LayerNorm gain of the 8-layer bf16
# pipeline; 2-layer ZeRO runs stay below that). Doubling or halving any one gradient
# moves it by 1.0 or 0.5 of that element: caught with a margin of 3 or more either way.
BF16_GRAD_RTOL = 0.15


def fit_bf16_against_reference(trainer, cfg):
    """Train in bf16, then check the first step's reduced gradients and norm, every loss
    and the fp32 master weights against the bf16 single-process run, to the BF16_*
    bounds; the master weights are the same on every replica. Collective over every
    rank. Returns (result, reference)."""
    import numpy as np

    from tests.reference import reference_run

    require_pinned_device(trainer)
    grid = trainer.grid
    first = capture_first_step(trainer)
    result = trainer.fit(close=False)
    ref = reference_run(cfg)
    assert_gradients_match(first, ref, grid.pp_comm if grid.pp > 1 else None,
                           rtol=BF16_GRAD_RTOL)
    np.testing.assert_allclose(result.losses, ref.losses, atol=BF16_LOSS_ATOL, rtol=0)
    master = trainer.engine.consolidated_state()
    assert set(master) == {n for n, _ in trainer.model.named_parameters()}
    for name, state in master.items():
        assert same_on_all_ranks(grid.dp_world.comm, state["param"]), name
        assert (state["param"] - ref.params[name]).abs().max() < BF16_PARAM_ATOL, name
    trainer.close()
    return result, ref


# Plain SGD without clipping (overrides for tiny_config): the update is lr x gradient.
SGD = {"optim.name": "sgd", "optim.lr": 0.1, "optim.grad_clip": 0.0, "optim.warmup_iters": 0,
       "optim.schedule": "constant", "train.max_iters": 6}


def bf16_accumulation_check(comm, level: int, micro_batches: int = 16) -> tuple[float, float]:
    """bf16 ZeRO-``level`` over ``comm`` (collective), ``micro_batches`` micro-batches per
    rank, each rank its own rows: the reduced gradient against the exact fp32 sum of the
    same bf16 per-micro-batch gradients (a bf16 copy of the model run alone on every
    rank's rows). Returns (largest error of the engine's gradient, largest error of the
    same sum accumulated in bf16), both relative to the largest gradient element."""
    import copy

    import torch

    from hpctrain.config import OptimConfig
    from hpctrain.model.gpt import GPT, GPTConfig
    from hpctrain.parallel.zero import Zero

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=32))
    alone = copy.deepcopy(model).to(torch.bfloat16)
    zero = Zero(model, cpu_world(comm), OptimConfig(), level=level, dtype="bf16",
                bucket_mb=0.01, first_bucket_mb=0.002, blocks=list(model.h))
    size, rank = comm.Get_size(), comm.Get_rank()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 32, (size, micro_batches, 2, 8), generator=gen)
    for m in range(micro_batches):
        zero.prepare_for_backward(last_micro=m == micro_batches - 1)
        (model(x[rank, m], x[rank, m]) * zero.grad_scale).backward()
    zero.finish()
    names = {id(p): n for n, p in model.named_parameters()}
    got = {}
    for b in zero.buckets:
        shard = b.grad_shard[:b.layout.shard].detach().clone()
        full = torch.cat(comm.allgather(shard)) if b.layout.world > 1 else shard
        for p, off in zip(b.params, b.layout.offsets):
            got[names[id(p)]] = full[off:off + p.numel()].view(p.shape)
    exact = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in alone.named_parameters()}
    in_bf16 = {n: torch.zeros_like(p) for n, p in alone.named_parameters()}
    for r in range(size):
        for m in range(micro_batches):
            alone.zero_grad(set_to_none=True)
            (alone(x[r, m], x[r, m]) * (1.0 / size)).backward()
            for n, p in alone.named_parameters():
                exact[n] += p.grad  # fp32 += bf16: exact to fp32 rounding
                in_bf16[n] += p.grad  # what accumulating in bf16 gives
    zero.close()
    err = max(float((got[n] - exact[n]).abs().max() / exact[n].abs().max()) for n in exact)
    err_bf16 = max(float((in_bf16[n].float() - exact[n]).abs().max() / exact[n].abs().max())
                   for n in exact)
    return err, err_bf16


def read_safetensors_by_hand(path) -> dict:
    """The format read by hand (8-byte header length, JSON header, raw data), so that
    the export's layout is checked without the safetensors package."""
    import json

    import torch

    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32"
        a, b = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32).reshape(
            info["shape"])
    return out


HUGE_ELEMENTS = 5_000_000_000
"""float32s a crafted shard declares: 18.6 GiB, inside the manifest's 2**40 bound."""


def crafted_checkpoint(directory, model: dict, elements: int = HUGE_ELEMENTS) -> Path:
    """A sharded checkpoint of about 11 KB that is consistent in itself (manifest, index,
    CRC-32s) and declares one parameter, ``wte.weight``, of ``elements`` float32s that
    are never written: a chunked dataset with no chunk, which HDF5 would read as its fill
    value after allocating all of it."""
    import json

    import h5py
    import numpy as np
    import torch

    from hpctrain.checkpoint.format import FORMAT, VERSION, shard_name
    from hpctrain.checkpoint.shard_file import crc32_of
    from hpctrain.checkpoint.sharded import zeros_crc32

    directory = Path(directory)
    directory.mkdir(parents=True)
    rng = torch.get_rng_state().numpy()
    crcs = {"rng/torch": crc32_of(rng)}
    with h5py.File(directory / shard_name(0), "w") as f:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            f.create_dataset(f"{key}/wte.weight", shape=(elements,), dtype=np.float32,
                             fillvalue=0.0, chunks=True)
            crcs[f"{key}/wte.weight"] = zeros_crc32(4 * elements)
        f["rng/torch"] = rng
    manifest = {"format": FORMAT, "version": VERSION, "step": 5, "optimizer_step": 5.0,
                "layout": "replicated", "world_size": 1, "model": model, "config": {},
                "tokenizer": None, "data": {"sampler": "epoch", "seed": 1, "next_step": 5},
                "index": {"params": {"wte.weight": [elements]}},
                "crc32": {shard_name(0): crcs}}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory



class ReadSpy:
    """Records every dataset read through h5py's ``Dataset.__getitem__`` (the names, in
    ``names``), for tests that a dataset was refused before it was read."""

    def __init__(self, monkeypatch):
        import h5py

        self.names = []
        real = h5py.Dataset.__getitem__

        def getitem(ds, key):
            self.names.append(ds.name)
            return real(ds, key)

        monkeypatch.setattr(h5py.Dataset, "__getitem__", getitem)


def two_ranks_suffice(why: str):
    """Skip a test in the legs with more than two ranks; ``why`` says why four would test
    nothing more (the 2-rank leg runs it, so the skip audit still sees it run)."""
    import pytest
    from mpi4py import MPI

    return pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 2, reason=f"two ranks suffice: {why}")


def assert_same_state(a: dict, b: dict, keys=None) -> None:
    """Two whole states (name -> {key: tensor}) hold the same names and, for each of
    ``keys`` (default: a checkpoint's, ``sharded.KEYS``), bit-identical tensors."""
    import torch

    from hpctrain.checkpoint.sharded import KEYS

    keys = KEYS if keys is None else keys
    assert set(a) == set(b)
    for name in a:
        for k in keys:
            assert torch.equal(torch.as_tensor(a[name][k]), torch.as_tensor(b[name][k])), \
                f"{name} {k}"


def resumes_exactly_and_reshards(fit, data, tmp: str, layout: dict, losses: list,
                                 step_dir: str = "checkpoints/step_000005") -> str:
    """After ``fit(data, tmp/big, **layout)`` saved ``step_dir``: a resume from it at the
    same layout repeats the big run's later losses bit for bit, and ``ckpt reshard
    --world 1`` (on rank 0) copies every tensor unchanged; returns the resharded path.
    ``fit`` returns (result, whole state). Collective over COMM_WORLD."""
    from mpi4py import MPI

    from hpctrain.checkpoint import ckpt_commands
    from hpctrain.checkpoint.sharded import read_full_state, read_manifest

    source = f"{tmp}/big/{step_dir}"
    again, _ = fit(data, f"{tmp}/again", **layout, **{"train.resume": source})
    assert again.losses == losses[5:]
    resharded = f"{tmp}/resharded"
    if MPI.COMM_WORLD.rank == 0:
        ckpt_commands.reshard(source, resharded, world=1, zero=0)
        assert_same_state(read_full_state(read_manifest(source)),
                          read_full_state(read_manifest(resharded)))
    return resharded
