"""Traps a newcomer met, each closed at the start: a GPT-2 dataset whose end-of-run sample
cannot be decoded here (no tiktoken, or no BPE file in its cache) fails before step 0
with one message naming the fix, not after the last step; a token file given to
``prepare`` as text is refused, naming ``--format``."""

import json
import subprocess
import sys
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.data.format import create_token_file
from hpctrain.errors import DataError
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config


def _gpt2_dataset(path):
    tokens = {name: (np.arange(n) % 50000).astype("<u2")
              for name, n in (("train", 4096), ("val", 1024))}
    offsets = create_token_file(
        path, n_tokens={k: len(v) for k, v in tokens.items()}, dtype=np.dtype("<u2"),
        tokenizer_meta={"name": "gpt2", "vocab_size": 50257}, sources=[],
        crcs={k: np.array([zlib.crc32(v.tobytes())], np.uint32) for k, v in tokens.items()})
    with open(path, "r+b") as f:
        for split, at in offsets.items():
            f.seek(at)
            f.write(tokens[split].tobytes())
    return path


def test_a_sample_that_cannot_be_decoded_fails_before_the_first_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    data = _gpt2_dataset(tmp_path / "gpt2.h5")
    cfg = tiny_config(data, tmp_path / "run", **{"train.sample_tokens": 5,
                                                 "train.save_checkpoint": True})
    with pytest.raises(DataError, match=r"sample_tokens.*(tiktoken|BPE file).*"
                                        r"--train.sample_tokens=0"):
        Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "final.h5").exists()


def test_without_a_sample_the_same_dataset_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    data = _gpt2_dataset(tmp_path / "gpt2.h5")
    cfg = tiny_config(data, tmp_path / "run", **{"train.sample_tokens": 0,
                                                 "train.max_iters": 2})
    result = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    assert len(result.losses) == 2


@pytest.mark.parametrize("tokenizer", ["byte", "char"])
def test_prepare_refuses_a_token_file_given_as_text(tmp_path, tokenizer):
    """A nanoGPT train.bin (uint16 ids) under --tokenizer byte became 80M tokens of
    garbage with exit 0; any text tokenizer now refuses it and names --format."""
    binary = tmp_path / "train.bin"
    binary.write_bytes((np.arange(20_000) % 50257).astype("<u2").tobytes())
    out = tmp_path / "out.h5"
    done = subprocess.run([sys.executable, "-m", "hpctrain", "prepare", "--input", str(binary),
                           "--output", str(out), "--tokenizer", tokenizer],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is binary, not text" in lines[0], done.stderr
    assert "--format nanogpt-bin" in lines[0] and not out.exists()


def test_the_final_evaluation_is_an_even_spread_of_at_most_its_batches(dataset_path, tmp_path):
    """By default it covered every window of the validation split (about 1,950 passes
    after a 50-step run, with nothing shown); now at most final_eval_batches x 64 windows,
    evenly spread, first and last included, with a bar."""
    cfg = tiny_config(dataset_path, tmp_path / "run", **{
        "train.final_eval": True, "train.max_iters": 2, "train.final_eval_batches": 2})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    starts, mine, every = trainer.batches.val_windows(2 * 64)
    assert every > 128 and len(starts) == len(set(starts.tolist())) == 128
    assert starts[0] == 0 and starts[-1] == (every - 1) * cfg.model.block_size
    assert np.all(np.diff(starts) >= (every // 128) * cfg.model.block_size)  # a spread
    passes = []
    forward = trainer.runner.forward_loss
    trainer.runner.forward_loss = lambda x, y: passes.append(len(x)) or forward(x, y)
    result = trainer.fit()
    assert passes == [64, 64] and result.final_val_loss is not None
    assert trainer.evaluator.covered.startswith(f"128 of the split's {every:,} windows")


def test_a_run_ended_by_an_error_says_so_in_its_status(dataset_path, tmp_path):
    """status.json is written on every way out: an error after the checkpoint of step 4
    records failed, the step a resume goes on from, and the error in one line."""
    from hpctrain.train.run_status import read_status, shell_line

    cfg = tiny_config(dataset_path, tmp_path / "run", **{
        "train.save_checkpoint": True, "train.ckpt_interval": 4})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    step = trainer.train_step

    def failing(n):
        if n == 6:
            raise DataError("token id 70000 in the data\nat row 3")
        return step(n)

    trainer.train_step = failing
    with pytest.raises(DataError):
        trainer.fit()
    status = read_status(tmp_path / "run")
    assert status["status"] == "failed" and status["step"] == 4
    assert shell_line(status) == "failed 4 10 DataError: token id 70000 in the data at row 3"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {k: summary[k] for k in status} == status and summary["config"] == cfg.to_dict()
