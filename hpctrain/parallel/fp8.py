"""``--train.fp8=true``: the transformer blocks' linear layers multiply in FP8.

torchao's float8 training (``convert_to_float8_training``) swaps each chosen
``nn.Linear`` for a ``Float8Linear``: before each matrix multiply it scales its operands
by their current absolute maximum (dynamic, tensorwise: no amax history to keep or
checkpoint), casts them to FP8 (e4m3 forward, e5m2 for the output gradient) and calls
``torch._scaled_mm``. Master weights, gradients and their reductions stay as
``--train.dtype`` has them. torchao rather than Transformer Engine: it is maintained
with PyTorch, is plain ``nn.Linear`` subclasses that keep their ``weight``/``bias``
(the engines' flat-buffer views, ZeRO-3's gathers and the checkpoint names stay as they
are) and composes with ``torch.compile``; Transformer Engine brings its own modules,
fused kernels and build, which would replace the model's layers and their names.

What is converted: the layers the family's plan splits in each block (attention and MLP
projections, and a MoE block's shared experts), when both their dimensions are multiples
of 16 (what ``_scaled_mm`` takes). Never the embedding, the head (the loss's precision),
the layer choosing experts or the routed experts themselves. The device check, what the
fake device proves and the loss bound: docs/design/fp8.md.

Under tensor parallelism (converted after the split) a column- or row-parallel layer
keeps its own forward and its collectives and is given an FP8 product for its local
matrix multiply (``Fp8Product``); each rank scales its own shard's operands, so a tp run
rounds differently from the single-process FP8 run (docs/design/fp8.md, "Tensor
parallelism").
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from hpctrain.errors import ConfigError
from hpctrain.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

SPLIT_LINEARS = (ColumnParallelLinear, RowParallelLinear)

FP8_ALIGN = 16
"""``torch._scaled_mm`` needs both dimensions of each operand to be multiples of 16."""

MIN_CAPABILITY = (8, 9)
"""NVIDIA's first FP8 tensor cores: Ada (8.9), then Hopper (9.0) and Blackwell (10.x)."""

ROCM_FP8_ARCHS = ("gfx94", "gfx95")
"""AMD's FP8 matrix cores that ``_scaled_mm`` targets: MI300-class (gfx942) and MI350
(gfx950)."""

INSTALL = "pip install 'hpctrain[gpu]' (or pip install torchao)"


@dataclass(frozen=True)
class Fp8Layers:
    """What ``convert_linears`` did: for the start-up line and the tests."""

    converted: tuple[str, ...]
    """Module paths of the layers now in FP8."""
    skipped: tuple[str, ...]
    """Module paths of the chosen layers left in bf16, their dimensions not multiples of 16."""
    emulated: bool
    """The fake device: the FP8 casts are real, the matrix multiply runs in fp32."""
    version: str

    def describe(self) -> str:
        how = "emulated on the fake device, " if self.emulated else ""
        line = (f"fp8: {len(self.converted)} linear layer(s) in FP8 ({how}dynamic tensorwise "
                f"scaling, torchao {self.version}), head and embeddings in bf16")
        if self.skipped:
            line += (f"; {len(self.skipped)} left in bf16, a dimension not a multiple of "
                     f"{FP8_ALIGN}: {', '.join(self.skipped)}")
        return line


def check_fp8_device(accel) -> bool:
    """Refuse, with one line naming the fix, a device without FP8 matrix units; return
    whether the FP8 math is emulated (the fake device)."""
    kind = accel.kind
    if kind == "fake":
        return True
    if kind == "cpu":
        raise ConfigError("--train.fp8=true needs a GPU with FP8 units, and this run "
                          "computes on the CPU: use --train.device=fake to run the FP8 "
                          "plumbing with emulated math, or drop --train.fp8")
    if kind == "xpu":
        raise ConfigError("--train.fp8=true: torchao's float8 training targets CUDA and "
                          "ROCm GPUs, not Intel XPUs: drop --train.fp8")
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(accel.index or 0).gcnArchName
        if not arch.startswith(ROCM_FP8_ARCHS):
            raise ConfigError(f"--train.fp8=true needs an AMD GPU with FP8 matrix cores "
                              f"(MI300-class, gfx94x/gfx95x); this one is {arch}: drop "
                              "--train.fp8")
        return False
    major, minor = torch.cuda.get_device_capability(accel.index or 0)
    if (major, minor) < MIN_CAPABILITY:
        raise ConfigError(f"--train.fp8=true needs an NVIDIA GPU of compute capability "
                          f"8.9 or newer (Ada, Hopper, Blackwell); this one is "
                          f"{major}.{minor}: drop --train.fp8")
    return False


class Fp8Product:
    """``x W^T`` in FP8 for a tensor-parallel layer that keeps its own weight, bias and
    collectives: the body of torchao's ``Float8Linear.forward`` without the bias (a
    row-parallel layer adds it after the group's sum; hpctrain runs no autocast), called
    with the layer's weight as it is at that moment (the engines may replace it by a
    bf16 view, ZeRO-3 gathers it). Holds no tensor: nothing to register, save or move;
    one serves every layer (torchao's matmul settings depend on the config alone)."""

    def __init__(self, config, float8):
        twin = float8.float8_linear.Float8Linear(FP8_ALIGN, FP8_ALIGN, bias=False,
                                                 config=config, device="meta")
        self.config, self.mm_config = twin.config, twin.linear_mm_config
        self.matmul = float8.float8_linear.matmul_with_hp_or_float8_args

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.matmul.apply(x, weight.t(), self.mm_config, self.config)


def fp8_candidates(model: torch.nn.Module) -> list[str]:
    """Module paths of the linear layers FP8 may take: the layers the plan splits in each
    block (whole, or this rank's column- or row-parallel part), and the same layers of a
    MoE block's shared experts."""
    plan = model.plan
    paths = {s.path for s in plan.block_splits}
    prefix = f"{plan.moe}."
    paths |= {f"{plan.moe}.shared.{p[len(prefix):]}" for p in paths if p.startswith(prefix)}
    out = []
    for i, blk in enumerate(model.get_submodule(plan.blocks)):
        for name, mod in blk.named_modules():
            if name in paths and (type(mod) is torch.nn.Linear
                                  or isinstance(mod, SPLIT_LINEARS)):
                out.append(f"{plan.blocks}.{i}.{name}")
    return out


def convert_linears(model: torch.nn.Module, *, emulate: bool, seq: int) -> Fp8Layers:
    """Swap ``model``'s FP8 candidates whose dimensions (this rank's, under tensor
    parallelism) fit for ``Float8Linear`` in place (the same ``weight`` and ``bias``
    parameters: call before the engine takes them); a tensor-parallel layer gets an
    ``Fp8Product`` for its local product instead.
    ``seq``: tokens per sequence on a rank; when not a multiple of 16, the tokens a
    weight gradient sums over may not be, and torchao pads that inner dimension."""
    torchao, float8 = _import_torchao()
    chosen, skipped = [], []
    for path in fp8_candidates(model):
        rows, cols = model.get_submodule(path).weight.shape
        fits = rows % FP8_ALIGN == 0 and cols % FP8_ALIGN == 0
        (chosen if fits else skipped).append(path)
    config = float8.Float8LinearConfig(emulate=emulate, pad_inner_dim=seq % FP8_ALIGN != 0)
    wanted, product = set(), Fp8Product(config, float8)
    for path in chosen:
        lin = model.get_submodule(path)
        if isinstance(lin, SPLIT_LINEARS):
            lin.fp8 = product
        else:
            wanted.add(path)
    float8.convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda _mod, fqn: fqn in wanted)
    return Fp8Layers(tuple(chosen), tuple(skipped), emulate, torchao.__version__)


def _import_torchao():
    """``(torchao, torchao.float8)``, or one line naming the install. A CPU-only build of
    torchao logs, at import, the GPU kernels it cannot load: quieted here."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    try:
        with contextlib.ExitStack() as stack:
            for log, level in zip(quiet, levels):
                log.setLevel(logging.ERROR)
                stack.callback(log.setLevel, level)
            import torchao
            import torchao.float8 as float8
    except ImportError as exc:
        raise ConfigError(f"--train.fp8=true needs torchao ({exc}): {INSTALL}") from None
    return torchao, float8


def fp8_parallelize(gpt: torch.nn.Module, grid, cfg) -> Fp8Layers:
    """Check the device and convert the whole ``gpt``, after the tensor split (its
    layers get their FP8 product) and before the pipeline cut and the engine (both keep
    the converted modules and their parameters)."""
    emulate = check_fp8_device(grid.world.accel)
    return convert_linears(gpt, emulate=emulate, seq=cfg.model.block_size // grid.cp)
