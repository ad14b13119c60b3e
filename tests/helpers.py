"""Small builders shared by the tests: tiny configs and real token files."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from hpctrain.config import build_config
from hpctrain.data.corpus import stdlib_files
from hpctrain.data.prepare import prepare

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"


def make_dataset(path: Path, max_bytes: int = 300_000, tokenizer: str = "char") -> Path:
    prepare(stdlib_files(max_bytes), path, tokenizer=tokenizer, show_progress=False)
    return Path(path)


def tiny_config(data_path, out_dir, **overrides):
    """A model small enough that 20 steps take well under a second."""
    recipe = {
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"path": str(data_path)},
        "optim": {"lr": 3e-3, "warmup_iters": 2, "min_lr": 3e-4},
        "train": {"batch_size": 8, "max_iters": 20, "log_interval": 5, "eval_interval": 0,
                  "final_eval": False, "out_dir": str(out_dir), "sample_tokens": 0,
                  "save_checkpoint": False, "progress": False, "threads": 1},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__", 1) if "__" in dotted else dotted.split(".", 1)
        recipe.setdefault(section, {})[key] = value
    return build_config(recipe)


def run(cmd: list[str], timeout: float = 120, env: dict | None = None,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run a command under a hard time limit (a hang fails the test, never the suite)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd)


def hpctrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpctrain", *args]


def mpiexec(n: int, *cmd: str) -> list[str]:
    return [MPIEXEC, "-n", str(n), *cmd]


def same_on_all_ranks(comm, tensor) -> bool:
    """True when ``tensor`` holds bit-identical values on every rank of ``comm``."""
    import numpy as np
    from mpi4py import MPI

    mine = tensor.detach().double().numpy().ravel()  # a copy, never a view of the storage
    root = comm.bcast(mine if comm.rank == 0 else None, root=0)
    return bool(comm.allreduce(int(np.array_equal(mine, root)), op=MPI.MIN))


def assert_matches_reference(trainer, result, cfg, comm=None) -> dict:
    """Per-step losses and final parameters equal the plain single-process loop (1e-5).
    Returns the reference's final parameters by name."""
    import numpy as np
    import torch

    from tests.reference import plain_torch_run

    ref_losses, ref_params = plain_torch_run(cfg)
    assert len(result.losses) == cfg.train.max_iters
    np.testing.assert_allclose(result.losses, ref_losses, atol=1e-5, rtol=0)
    gathered = trainer.dp.gathered() if trainer.zero else contextlib.nullcontext()
    with gathered:
        for name, p in trainer.model.named_parameters():
            torch.testing.assert_close(p.detach(), ref_params[name], atol=1e-5, rtol=0)
            if comm is not None:
                assert same_on_all_ranks(comm, p), f"{name} differs between ranks"
    return ref_params
