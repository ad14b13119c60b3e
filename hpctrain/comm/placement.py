"""Which device a rank computes on: the kind (``--train.device``, the system profile's
promise of GPUs) and the device of that kind (the launcher's visibility masks).
docs/design/devices.md explains the rules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hpctrain.comm.device import Accelerator, GPUAccelerator
from hpctrain.comm.fake_device import FakeAccelerator
from hpctrain.errors import UserError
from hpctrain.profiling import use_profiler

KINDS = ("auto", "cpu", "cuda", "xpu", "fake")
AUTO_ENV = "HPCTRAIN_AUTO_DEVICE"
"""Names the kind ``--train.device=auto`` takes on this node, instead of the GPU it finds
(the test suite sets it to ``cpu``, so that its results never depend on the node)."""

# The variables a launcher narrows a rank's GPUs with, per kind (ROCm reads all three).
VISIBILITY_ENV = {
    "cuda": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
    "xpu": ("ZE_AFFINITY_MASK",),
}


@dataclass(frozen=True)
class Visible:
    """The devices of one kind this process sees, and the launcher's mask if it set one."""
    count: int
    mask: str | None = None
    """``NAME=value`` of the first visibility variable set, None when none is."""


def visible_devices(kind: str, env=None) -> Visible:
    env = os.environ if env is None else env
    mask = next((f"{k}={env[k]}" for k in VISIBILITY_ENV.get(kind, ()) if k in env), None)
    count = 0
    if kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if module is not None and module.is_available():
            count = module.device_count()
    return Visible(count, mask)


def device_index(local_rank: int, count: int, masks: list[str | None]) -> tuple[int, str]:
    """This rank's device among the ``count`` it sees, and how it was chosen.

    ``masks``: every rank of the node's visibility setting. When they differ, the
    launcher gave each rank its own device(s) (ALCF's affinity scripts, ``--gpu-bind``):
    take the first one. When they agree (or none is set) the node's ranks see the same
    devices and share them out: ``local_rank % count``.
    """
    mine = masks[local_rank] if local_rank < len(masks) else None
    if mine is not None and len(set(masks)) > 1:
        return 0, f"{mine} per rank"
    index = local_rank % count
    share = len(masks) > count
    how = f"local rank {local_rank} of {len(masks)} on {count} visible"
    return index, how + (" (ranks share devices)" if share else "")


def gpus_promised(system: str | None) -> int:
    """GPUs per node that the system profile ``system`` (HPCTRAIN_SYSTEM) promises; 0
    when it names none or cannot be read (the job script's own check reports that)."""
    if not system:
        return 0
    from hpctrain.systems.registry import load_system

    try:
        return load_system(system).launch.gpus_per_node
    except UserError:
        return 0


def _torch_build() -> str:
    if torch.version.cuda:
        return f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    if torch.version.hip:
        return f"torch {torch.__version__} (ROCm {torch.version.hip})"
    if getattr(torch.version, "xpu", None):
        return f"torch {torch.__version__} (XPU)"
    return f"torch {torch.__version__}, a CPU-only build"


def choose_kind(setting: str, *, system: str | None = None,
                visible: dict[str, Visible] | None = None, env=None) -> str:
    """The device kind for ``--train.device=setting``; a one-line ``UserError`` naming
    the fix when the setting cannot be met. ``auto`` takes ``HPCTRAIN_AUTO_DEVICE`` when
    it is set."""
    if setting not in KINDS:
        raise UserError(f"--train.device={setting!r} is not one of {', '.join(KINDS)}")
    env = os.environ if env is None else env
    if setting == "auto" and env.get(AUTO_ENV):
        setting = env[AUTO_ENV]
        if setting not in KINDS[1:]:
            raise UserError(f"{AUTO_ENV}={setting!r} is not one of {', '.join(KINDS[1:])}; "
                            f"unset it to let --train.device=auto find the node's GPU")
    if setting in ("cpu", "fake"):
        return setting
    visible = visible if visible is not None else {k: visible_devices(k) for k in ("cuda", "xpu")}
    if setting in ("cuda", "xpu"):
        v = visible[setting]
        if v.count == 0:
            mask = f" with {v.mask}" if v.mask else ""
            raise UserError(f"--train.device={setting}: this process sees no {setting} device"
                            f"{mask} ({_torch_build()}); run on a node with one and a torch "
                            f"built for it, or pass --train.device=auto or cpu")
        return setting
    for kind in ("cuda", "xpu"):
        if visible[kind].count:
            return kind
    promised = gpus_promised(system)
    if promised:
        masks = [v.mask for v in visible.values() if v.mask]
        mask = f", {masks[0]}" if masks else ""
        raise UserError(f"HPCTRAIN_SYSTEM={system} promises {promised} GPU(s) per node but "
                        f"this rank sees none ({_torch_build()}{mask}); request GPUs in the "
                        "job and install a GPU build of torch, or pass --train.device=cpu to "
                        "train on CPU cores on purpose")
    return "cpu"


def make_accelerator(kind: str, local_rank: int, masks: list[str | None]) -> Accelerator:
    """The device of this rank (``masks``: the visibility setting of each rank on the
    node). Makes it the current device of its kind."""
    if kind == "cpu":
        return Accelerator()
    if kind == "fake":
        return FakeAccelerator(local_rank, placement=f"local rank {local_rank}")
    index, how = device_index(local_rank, visible_devices(kind).count, masks)
    getattr(torch, kind).set_device(index)
    use_profiler("itt" if kind == "xpu" else "nvtx")
    return GPUAccelerator(kind, index, placement=how)
