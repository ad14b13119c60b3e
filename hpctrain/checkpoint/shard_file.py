"""Reading one rank's shard of a sharded checkpoint (``sharded.py`` has the format).

A shard is read one dataset at a time, and each dataset only after three checks that
need no reading: its declared shape and type are what the manifest says, the file
stores every byte of it (``hpctrain.sizes.StoredReads``: a few kilobytes that declare
gigabytes never become an allocation), and then, once read, its CRC-32 is the
manifest's. The one dataset stored as nothing is a never-written Adam moment of
imported weights (``sharded.Zeros``), next to the parameter it belongs to.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from hpctrain.checkpoint.format import CheckpointError, shard_name
from hpctrain.sizes import StoredReads

MOMENTS = ("exp_avg", "exp_avg_sq")
DAMAGED = "the shard is damaged: resume from an older step_N directory"


def crc32_of(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data) & 0xFFFFFFFF


class ShardFile:
    """Rank ``rank``'s shard of the checkpoint in ``directory``, open for reading (a
    context manager). ``crcs``: the manifest's CRC-32 of each of its datasets;
    ``location``: the file and group that hold it (``format.shard_locations``), by
    default the rank's own file."""

    def __init__(self, directory: Path, rank: int, crcs: dict[str, int],
                 location: tuple[str, str] | None = None):
        import h5py

        name, self.group = location or (shard_name(rank), "")
        self.path = Path(directory) / name
        self.where = f"{self.path}" + (f" (group {self.group})" if self.group else "")
        self.manifest_path = Path(directory) / "manifest.json"
        self.crcs = crcs
        if not self.path.is_file():
            raise CheckpointError(f"checkpoint shard {self.path} is missing; the checkpoint "
                                  "is incomplete: resume from an older step_N directory")
        try:
            self.file = h5py.File(self.path, "r")
        except OSError as e:
            raise CheckpointError(f"checkpoint shard {self.path} is not readable HDF5 "
                                  f"(truncated?): {e}; resume from an older step_N "
                                  "directory") from None
        if self.group and not isinstance(self.file.get(self.group), h5py.Group):
            self.file.close()
            raise CheckpointError(f"{self.path} has no group {self.group} (rank {rank}'s "
                                  f"shard); {DAMAGED}")
        self.reads = StoredReads(self.path, error=CheckpointError, fix=DAMAGED)

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def read(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """Dataset ``name``, after its declared shape and type match the manifest's and
        the file stores it whole; then checked against its CRC-32."""
        try:
            d = self._dataset(name)
            declared = (tuple(d.shape) if d.shape is not None else None, np.dtype(d.dtype))
            want = (tuple(shape), np.dtype(dtype))
            if declared != want:
                raise CheckpointError(
                    f"{self.where}: dataset {name} is declared {_describe(*declared)}, "
                    f"{self.manifest_path} says {_describe(*want)}; the checkpoint is "
                    "damaged: resume from an older step_N directory")
            self.reads.check(d, name, zeros_of=self._parameter_of(name))
            a = d[()]
        except (KeyError, OSError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.where}: dataset {name} is unreadable ({e}); "
                                  f"{DAMAGED}") from None
        expected = self.crcs.get(name)
        if expected is None or crc32_of(a) != expected:
            raise CheckpointError(f"{self.where}: dataset {name} fails its CRC-32 check; the "
                                  "shard is corrupt: resume from an older step_N directory")
        return a

    def _dataset(self, name: str):
        import h5py

        d = self.file[f"{self.group}/{name}" if self.group else name]
        if not isinstance(d, h5py.Dataset):
            raise KeyError(f"{name} is a group")
        return d

    def _parameter_of(self, name: str):
        """The parameter dataset beside moment dataset ``name`` (``exp_avg/wte.weight``
        -> ``param/wte.weight``, ``bucket_0/exp_avg_sq`` -> ``bucket_0/param``), or None."""
        parts = name.split("/")
        if not any(p in MOMENTS for p in parts):
            return None
        try:
            return self._dataset("/".join("param" if p in MOMENTS else p for p in parts))
        except KeyError:
            return None


def _describe(shape, dtype) -> str:
    return f"{dtype} of shape {shape}"
