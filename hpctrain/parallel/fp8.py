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
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from hpctrain.errors import ConfigError

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


def fp8_candidates(model: torch.nn.Module) -> list[str]:
    """Module paths of the linear layers FP8 may take: the layers the plan splits in each
    block, and the same layers of a MoE block's shared experts."""
    plan = model.plan
    paths = {s.path for s in plan.block_splits}
    prefix = f"{plan.moe}."
    paths |= {f"{plan.moe}.shared.{p[len(prefix):]}" for p in paths if p.startswith(prefix)}
    out = []
    for i, blk in enumerate(model.get_submodule(plan.blocks)):
        for name, mod in blk.named_modules():
            if name in paths and type(mod) is torch.nn.Linear:
                out.append(f"{plan.blocks}.{i}.{name}")
    return out


def convert_linears(model: torch.nn.Module, *, emulate: bool, seq: int) -> Fp8Layers:
    """Swap ``model``'s FP8 candidates whose dimensions fit for ``Float8Linear`` in place
    (the same ``weight`` and ``bias`` parameters: call before the engine takes them).
    ``seq``: tokens per sequence on a rank; when not a multiple of 16, the tokens a
    weight gradient sums over may not be, and torchao pads that inner dimension."""
    torchao, float8 = _import_torchao()
    chosen, skipped = [], []
    for path in fp8_candidates(model):
        lin = model.get_submodule(path)
        fits = lin.in_features % FP8_ALIGN == 0 and lin.out_features % FP8_ALIGN == 0
        (chosen if fits else skipped).append(path)
    config = float8.Float8LinearConfig(emulate=emulate, pad_inner_dim=seq % FP8_ALIGN != 0)
    wanted = set(chosen)
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
    """Check the device and convert the whole ``gpt`` (before the pipeline cut and the
    engine: both keep the converted modules and their parameters)."""
    if grid.tp > 1:
        raise ConfigError("--train.fp8=true converts the blocks' nn.Linear layers, and "
                          f"--parallel.tp={grid.tp} replaces them with its own "
                          "column- and row-parallel layers, which have no FP8 path: drop "
                          "one of them (--parallel.tp=1)")
    emulate = check_fp8_device(grid.world.accel)
    return convert_linears(gpt, emulate=emulate, seq=cfg.model.block_size // grid.cp)
