"""``prepare`` from records files over real MPI ranks (``mpiexec -n 2`` and ``-n 4``): one
file shared out among every rank by byte ranges or row groups writes the bytes one
process writes, for each format; bad records are counted the same and fail every rank
before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi4py import MPI

from hpctrain.data.prepare import assign_files, prepare
from hpctrain.data.sources import plan_units
from hpctrain.errors import DataError
from tests.test_corpora import DOCS, write_records

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


def _on_root(fn):
    if COMM.rank == 0:
        fn()
    COMM.Barrier()


def _parallel_equals_one_process(inputs, folder: Path, **kwargs) -> dict:
    par = prepare(inputs, folder / "par.h5", show_progress=False, comm=COMM, **kwargs)
    if COMM.rank == 0:
        one = prepare(inputs, folder / "one.h5", show_progress=False, **kwargs)
        assert (folder / "par.h5").read_bytes() == (folder / "one.h5").read_bytes()
        assert {k: v for k, v in one.items() if k not in ("output", "ranks")} == \
               {k: v for k, v in par.items() if k not in ("output", "ranks")}
    COMM.Barrier()
    return par


@pytest.mark.parametrize("name,tokenizer", [("c.jsonl", "char"), ("c.jsonl", "byte"),
                                            ("c.jsonl.gz", "byte"), ("c.json.zst", "char"),
                                            ("c.parquet", "char"), ("c.arrow", "byte")])
def test_one_records_file_over_every_rank_writes_the_single_process_bytes(
        shared_tmp, name, tokenizer):
    folder = Path(shared_tmp)
    path = folder / name
    _on_root(lambda: write_records(path))
    _parallel_equals_one_process([path], folder, tokenizer=tokenizer)
    if name in ("c.jsonl", "c.parquet"):  # shared by every rank, not one rank's whole file
        size = path.stat().st_size
        groups = [[1] * 9] if name == "c.parquet" else [[]]
        units = plan_units([size], [name.split(".", 1)[1]], groups, COMM.size)
        runs = assign_files([u[3] for u in units], COMM.size)
        assert all(hi > lo for lo, hi in runs)


def test_text_and_records_files_mixed_write_the_single_process_bytes(shared_tmp):
    folder = Path(shared_tmp)

    def make():
        (folder / "in").mkdir()
        write_records(folder / "in" / "b.jsonl", DOCS[:120])
        write_records(folder / "in" / "c.parquet", DOCS[120:])
        (folder / "a.txt").write_text("a text file, no newline at its end")
    _on_root(make)
    _parallel_equals_one_process([folder / "a.txt", folder / "in"], folder, tokenizer="char")


def test_bad_records_fail_every_rank_alike_and_skip_alike(shared_tmp):
    folder = Path(shared_tmp)
    path = folder / "c.jsonl"

    def make():
        lines = write_records(path).read_bytes().splitlines(keepends=True)
        for k in (3, 90, 180):  # in different ranks' ranges
            lines[k] = json.dumps({"text": k}).encode() + b"\n"
        path.write_bytes(b"".join(lines))
    _on_root(make)
    with pytest.raises(DataError) as err:
        prepare([path], folder / "par.h5", show_progress=False, comm=COMM)
    assert str(err.value).startswith("3 bad record(s) in the input (first: ")
    assert f"{path}:line 4: field 'text' is a number" in str(err.value)
    assert f"{path}:line 181:" in str(err.value)
    assert not (folder / "par.h5").exists()
    COMM.Barrier()
    s = _parallel_equals_one_process([path], folder, tokenizer="byte", on_bad_record="skip")
    assert s["bad_records"] == 3
