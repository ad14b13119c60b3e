"""Where commands may write (``hpctrain/output_paths.py``): never over a device, FIFO or
link (``--overwrite`` or not), never over an input or an earlier output read as input,
never over another run's outputs; the same input twice is refused. Each refusal is one
line, exit 2, and leaves everything as it was."""

import os
import stat

import pytest
from mpi4py import MPI

from hpctrain.cli import main
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config


@pytest.fixture(scope="module")
def run_dir(dataset_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = tiny_config(dataset_path, out, **{"train.save_checkpoint": True,
                                            "train.max_iters": 2})
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    return out


def _specials(folder):
    """A FIFO, and where this process may make one (root) a character device like
    /dev/null, in ``folder``: the real /dev/null is never put at risk."""
    fifo = folder / "pipe"
    os.mkfifo(fifo)
    out = [fifo]
    if os.geteuid() == 0:
        null = folder / "null"
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        out.append(null)
    return out


def _still_special(paths) -> None:
    for p in paths:
        mode = os.lstat(p).st_mode
        assert stat.S_ISFIFO(mode) or stat.S_ISCHR(mode), p


def _refused(argv, capsys, *words) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert all(w in err for w in words), err
    return err


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_prepare_never_replaces_a_device_or_a_fifo(tmp_path, capsys, overwrite):
    specials = _specials(tmp_path)
    for target in specials:
        _refused(["prepare", "--corpus", "stdlib", "--max-bytes", "1000", "--output",
                  str(target), *overwrite], capsys, "not a regular file")
    _still_special(specials)


def test_prepare_never_writes_over_its_input_or_reads_its_earlier_output(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = corpus / "a.txt"
    text.write_text("some text\n" * 50)
    _refused(["prepare", "--input", str(text), "--output", str(text), "--overwrite"],
             capsys, "is one of the inputs")
    assert text.read_text() == "some text\n" * 50
    out = corpus / "d.h5"  # inside the input folder: fine the first time...
    assert main(["prepare", "--input", str(corpus), "--output", str(out),
                 "--tokenizer", "byte"]) == 0
    capsys.readouterr()
    before = out.read_bytes()
    # ...but again it is one of the files the folder expands to
    _refused(["prepare", "--input", str(corpus), "--output", str(out), "--tokenizer", "byte",
              "--overwrite"], capsys, "is one of the inputs")
    assert out.read_bytes() == before


def test_the_same_input_twice_is_refused(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("some text\n" * 50)
    _refused(["prepare", "--input", str(text), str(tmp_path / "." / "a.txt"), "--output",
              str(tmp_path / "d.h5")], capsys, "is given twice")
    assert not (tmp_path / "d.h5").exists()


def test_ckpt_tools_never_replace_a_device_fifo_or_a_runs_outputs(run_dir, tmp_path,
                                                                  capsys):
    specials = _specials(tmp_path)
    _refused(["ckpt", "merge", str(run_dir), "--output", str(specials[0])], capsys,
             "not a regular file")
    _refused(["ckpt", "export", str(run_dir), "--format", "safetensors", "--output",
              str(specials[-1])], capsys, "not a regular file")
    final = (run_dir / "final.h5").read_bytes()
    _refused(["ckpt", "merge", str(run_dir), "--output", str(run_dir / "final.h5")], capsys,
             "would replace an output of the run")
    assert (run_dir / "final.h5").read_bytes() == final
    _refused(["ckpt", "export", str(run_dir), "--format", "hf", "--output", str(run_dir)],
             capsys, "holds a training run")
    _refused(["ckpt", "reshard", str(run_dir), "--world", "2", "--zero", "1", "--output",
              str(run_dir / "checkpoints" / "resharded")], capsys, "inside the input")
    _still_special(specials)
    # beside a run's files (not one of them, not in a checkpoint) a merge is fine
    assert main(["ckpt", "merge", str(run_dir), "--output", str(run_dir / "merged.h5")]) == 0
