"""``--train.wandb=offline|online``: rank 0 logs the run's scalars (the tags of
``tensorboard.TAGS``, as TensorBoard gets them) and its configuration, once, to Weights &
Biases.

Offline (compute nodes often reach no network), the run is written under
``<out_dir>/wandb/``, and the end of the run prints the ``wandb sync`` command that uploads
it from a login node. The W&B run id is kept in ``<out_dir>/wandb/hpctrain-run-id``: a
resumed run continues the same W&B run (offline, each start adds a folder of that id;
``wandb sync`` given them all uploads them in order, into one run). A fresh start moves
``wandb/`` aside with the run's other outputs (``output_paths.RUN_OUTPUTS``) and gets a new
id."""

from __future__ import annotations

import re
import secrets
import shlex
import string
from pathlib import Path
from typing import Any, Callable

from hpctrain.atomic import temporary_file
from hpctrain.errors import ConfigError, UserError

WANDB_DIR = "wandb"
"""The folder under out_dir that W&B writes into (its own name for it)."""
RUN_ID_FILE = "hpctrain-run-id"
"""In ``WANDB_DIR``: the id every start of this run logs to."""
INSTALL = "pip install 'hpctrain[wandb]'"
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def wandb_module(setting: str):
    """The ``wandb`` module for ``offline`` or ``online``, None for ``off``; a
    ``ConfigError`` naming the install when it is asked for and missing."""
    if setting == "off":
        return None
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(f"--train.wandb={setting} needs the wandb package ({e}): run "
                          f"`{INSTALL}`, or pass --train.wandb=off") from None
    return wandb


def new_run_id() -> str:
    """Eight random lowercase letters and digits, the shape of W&B's own run ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def run_id(folder: Path, new_id: Callable[[], str] = new_run_id) -> str:
    """The W&B run id kept in ``folder``; a new one, written there, when none is."""
    path = folder / RUN_ID_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}; remove it to start a new W&B run") \
            from None
    if text is not None:
        if not _ID.fullmatch(text):
            raise UserError(f"{path} holds {text[:40]!r}, not a W&B run id; remove it to "
                            "start a new W&B run")
        return text
    identifier = new_id()
    with temporary_file(path) as tmp:  # whole or absent, whenever the job is killed
        tmp.write_text(identifier + "\n")
    return identifier


def offline_folders(folder: Path, identifier: str) -> list[Path]:
    """The folders of the run's offline starts, oldest first: W&B names each
    ``offline-run-<start second>-<id>``, with ``-1``, ``-2``... added when a folder of
    that second already exists."""
    name = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(identifier)}(?:-(\d+))?")
    found = [(m.group(1), int(m.group(2) or 0), path) for path in folder.iterdir()
             if (m := name.fullmatch(path.name))] if folder.is_dir() else []
    return [path for _, _, path in sorted(found)]


def sync_command(folder: Path, identifier: str) -> str:
    """The command that uploads every offline start of the run, oldest first."""
    return "wandb sync " + " ".join(shlex.quote(str(d))
                                    for d in offline_folders(folder, identifier))


class WandbLog:
    """Rank 0's W&B run."""

    def __init__(self, wandb, run: Any, mode: str, folder: Path, identifier: str,
                 log: Callable[[str], None] = print):
        self.wandb, self.run, self.mode = wandb, run, mode
        self.folder, self.identifier = folder, identifier
        self._log = log

    @classmethod
    def start(cls, wandb, cfg, log: Callable[[str], None] = print) -> WandbLog:
        """Start (or continue) the run's W&B run, its configuration logged once."""
        t = cfg.train
        out_dir = Path(t.out_dir)
        folder = out_dir / WANDB_DIR
        identifier = run_id(folder)
        try:
            run = wandb.init(project=t.wandb_project,
                             name=t.wandb_name or out_dir.resolve().name,
                             id=identifier, resume="allow", dir=str(out_dir), mode=t.wandb,
                             config=cfg.to_dict(),
                             # The run's own output stays as it is: no capture of stdout.
                             settings=wandb.Settings(console="off"))
        except Exception as e:  # wandb's errors share no base class of their own
            raise UserError(f"W&B could not start the run ({type(e).__name__}: {e}); online, "
                            "run `wandb login` first; or pass --train.wandb=offline (or "
                            "off)") from None
        return cls(wandb, run, t.wandb, folder, identifier, log)

    def log(self, scalars: dict[str, float], step: int) -> None:
        if scalars:
            self.run.log(scalars, step=step)

    def close(self) -> None:
        """Finish the W&B run; offline, say how to upload it."""
        self.run.finish()
        # ``finish`` can return before wandb's service has written the last records;
        # stopping the service waits for them, so the run's files are whole from here on.
        self.wandb.teardown()
        if self.mode == "offline":
            self._log(f"W&B run {self.identifier} is offline in {self.folder}; upload it "
                      f"from a node with network: {sync_command(self.folder, self.identifier)}")
