"""``prepare --format`` over real MPI ranks: each rank converts its run of every split and
the file is byte for byte the one a single process writes (nanoGPT single file and
train/val pair, Megatron pair, in many small chunks too); an id outside the vocabulary
in the last rank's run fails every rank with the same message and writes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm.small_collectives import allgather_json
from hpctrain.data import token_import
from hpctrain.errors import DataError
from tests.test_token_import import (gpt2_documents, megatron_docs, write_megatron,
                                     write_nanogpt)

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


def _sources(folder: Path) -> dict:
    """The inputs of each case, written by rank 0."""
    if COMM.rank == 0:
        folder.mkdir()
        write_nanogpt(folder / "one.bin", np.concatenate(gpt2_documents(300)))
        write_nanogpt(folder / "train.bin", np.concatenate(gpt2_documents(40, 1)))
        write_nanogpt(folder / "val.bin", np.concatenate(gpt2_documents(9, 2)))
        write_megatron(folder / "m_text_document", megatron_docs(90, 80_000))
    COMM.Barrier()
    return {"single": (["one.bin"], {"fmt": "nanogpt-bin"}),
            "pair": (["train.bin", "val.bin"], {"fmt": "nanogpt-bin"}),
            "megatron": (["m_text_document"], {"fmt": "megatron", "vocab_size": 80_000})}


@pytest.mark.parametrize("chunk", [None, 34], ids=["whole", "chunks"])
@pytest.mark.parametrize("case", ["single", "pair", "megatron"])
def test_every_rank_converts_its_share_and_the_file_is_one_process(shared_tmp, monkeypatch,
                                                                   case, chunk):
    if chunk:
        monkeypatch.setattr(token_import, "CHUNK_BYTES", chunk)
    folder = Path(shared_tmp) / "src"
    names, kw = _sources(folder)[case]
    inputs = [str(folder / n) for n in names]
    s = token_import.import_tokens(inputs, folder.parent / "par.h5", comm=COMM, **kw)
    assert s["ranks"] == COMM.size
    if COMM.rank == 0:
        token_import.import_tokens(inputs, folder.parent / "one.h5", **kw)
        assert (folder.parent / "par.h5").read_bytes() == (folder.parent / "one.h5").read_bytes()
    COMM.Barrier()


def test_an_id_past_the_vocabulary_on_the_last_rank_fails_every_rank_alike(shared_tmp):
    folder = Path(shared_tmp)
    if COMM.rank == 0:
        ids = np.concatenate(gpt2_documents(200))
        ids[-3] = 50300  # in the validation split's last rank's run
        write_nanogpt(folder / "bad.bin", ids)
    COMM.Barrier()
    with pytest.raises(DataError) as caught:
        token_import.import_tokens([str(folder / "bad.bin")], folder / "out.h5",
                                   fmt="nanogpt-bin", comm=COMM)
    messages = allgather_json(COMM, str(caught.value), timeout=60, what="messages")
    assert len(set(messages)) == 1
    assert "is 50300, not an id of a vocabulary of 50257" in messages[0]
    assert sorted(p.name for p in folder.iterdir()) == ["bad.bin"]
    COMM.Barrier()
