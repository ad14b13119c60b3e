"""A node-local copy of the dataset, made before training (``--data.local_copy_dir``).

On Polaris every node has local NVMe at ``/local/scratch``: reading from there keeps
training's small random reads off Lustre. One rank per node (local rank 0) copies each
file under a temporary name and renames it into place; a copy with the same size and
modification time is reused, so the next job on the node starts at once. Checksums are
verified on the copy afterwards (``--data.verify``), like any dataset.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpctrain.data.dataset import DatasetInfo
from hpctrain.errors import DataError


def local_copy_paths(info: DatasetInfo, copy_dir: str | os.PathLike) -> list[Path]:
    """Where each file of ``info`` goes in ``copy_dir`` (names cannot collide)."""
    root = Path(copy_dir)
    if len(info.files) == 1:
        return [root / info.files[0].name]
    return [root / f"{info.path.stem}-{i:05d}-{f.name}" for i, f in enumerate(info.files)]


def make_local_copy(info: DatasetInfo, copy_dir: str | os.PathLike) -> list[Path]:
    """Copy (or reuse) every file of ``info`` into ``copy_dir``; one process per node."""
    dests = local_copy_paths(info, copy_dir)
    try:
        Path(copy_dir).mkdir(parents=True, exist_ok=True)
        todo = [(s, d) for s, d in zip(info.files, dests) if not _same(s, d)]
        need = sum(s.stat().st_size for s, _ in todo)
        free = shutil.disk_usage(copy_dir).free
        if need > free:
            raise DataError(f"--data.local_copy_dir={copy_dir} has {free / 1e9:.1f} GB free, the "
                            f"dataset needs {need / 1e9:.1f} GB more; free space there or "
                            "train without --data.local_copy_dir")
        for src, dst in todo:
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
            try:
                shutil.copyfile(src, tmp)
                shutil.copystat(src, tmp)  # the modification time marks a finished copy
                os.replace(tmp, dst)
            finally:
                tmp.unlink(missing_ok=True)
    except OSError as e:
        raise DataError(f"cannot copy the dataset to --data.local_copy_dir={copy_dir}: {e}; "
                        "check the directory (it must be writable on every node) or train "
                        "without --data.local_copy_dir") from None
    return dests


def _same(src: Path, dst: Path) -> bool:
    if not dst.is_file():
        return False
    a, b = src.stat(), dst.stat()
    return a.st_size == b.st_size and int(a.st_mtime) == int(b.st_mtime)
