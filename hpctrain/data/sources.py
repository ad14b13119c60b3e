"""What ``prepare`` reads, and how the reading is shared out among ranks. No MPI here.

An input is a text file, a file of records (JSON lines, Parquet, Arrow IPC; read by
``document_reader.py``), or a directory or glob of those; a dataset directory contributes only
its records files. The work is planned as units, each one piece of one file in input
order (byte ranges of plain JSON lines, Parquet row groups, other files whole), and
ranks take contiguous runs of units of about equal bytes (``assign_files``), so one
large shard is prepared by every rank. The rules and their reasons:
``docs/design/data-path.md`` ("What is read", "How work is shared").
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import DataError
from hpctrain.sizes import MiB

TEXT, JSONL, JSONL_GZ, JSONL_ZST, PARQUET, ARROW = (
    "text", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow")
RECORD_SUFFIXES = {".jsonl": JSONL, ".json": JSONL, ".jsonl.gz": JSONL_GZ,
                   ".json.gz": JSONL_GZ, ".jsonl.zst": JSONL_ZST, ".json.zst": JSONL_ZST,
                   ".parquet": PARQUET, ".arrow": ARROW}
# JSON files a Hugging Face dataset directory keeps beside its data (not records).
DATASET_METADATA = {"dataset_info.json", "dataset_dict.json", "state.json"}
MAX_UNIT_BYTES = 64 * MiB
"""A byte range of JSON lines is at most this long (and about a quarter of a rank's share
on small inputs, so that small corpora are shared out too)."""


def file_format(path: str | Path) -> str:
    """The format of ``path`` by its name (case-insensitive); anything else is text."""
    name = Path(path).name.lower()
    for suffix in sorted(RECORD_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix) and name not in DATASET_METADATA:
            return RECORD_SUFFIXES[suffix]
    return TEXT


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Every input file in order: directories (see the module docstring) and globs
    expand to sorted lists."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and not any(s.startswith(".")
                                                      for s in p.relative_to(path).parts))
            records = [p for p in found if file_format(p) != TEXT]
            found = records or found
        elif any(ch in item for ch in "*?["):
            found = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
        elif path.is_file():
            found = [path]
        else:
            raise DataError(f"input {item} does not exist; give text or records files "
                            "(.jsonl, .json, .jsonl.gz, .jsonl.zst, .parquet, .arrow), "
                            "directories or globs")
        if not found:
            raise DataError(f"input {item} matched no files")
        files.extend(found)
    return files


def plan_units(sizes: list[int], formats: list[str], row_group_bytes: list[list[int]],
               n_ranks: int, max_unit_bytes: int = MAX_UNIT_BYTES) -> list[list[int]]:
    """The units of work, ``[file, start, stop, weight]``, in input order.

    ``row_group_bytes[i]`` holds the on-disk size of each row group of file ``i`` when it
    is Parquet (ignored otherwise). A Parquet unit spans row groups ``[start, stop)``, a
    JSON-lines unit bytes ``[start, stop)``; any other unit is the whole file.
    """
    target = max(1, min(max_unit_bytes, -(-sum(sizes) // (4 * n_ranks))))
    units = []
    for i, (size, fmt) in enumerate(zip(sizes, formats)):
        if fmt == JSONL and size > 0:
            n = -(-size // target)
            cuts = [size * k // n for k in range(n + 1)]
            units += [[i, a, b, b - a] for a, b in zip(cuts, cuts[1:])]
        elif fmt == PARQUET:
            units += [[i, g, g + 1, w] for g, w in enumerate(row_group_bytes[i])]
        else:
            units.append([i, 0, size, size])
    return units


@dataclass
class Plan:
    """Every rank's view of the work: the input files, their formats, every unit, and
    this rank's run of units ``units[lo:hi]``."""
    names: list[str]
    formats: list[str]
    units: list[list[int]]
    lo: int
    hi: int

    @property
    def mine(self) -> list[list[int]]:
        return self.units[self.lo:self.hi]

    @property
    def has_records(self) -> bool:
        return any(fmt != TEXT for fmt in self.formats)
