"""One rule for sizes (``hpctrain/sizes.py``): every size read from a file or the command
line is bounded and finite before anything is allocated, and a dataset is read only when
its file stores every byte it declares. A crafted shard of about 11 KB that declares
18.6 GiB, absurd or NaN numbers in configs, imported configs, tokenizer records, dataset
headers and ``ckpt reshard --world``: each is one message, before any allocation."""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess

import h5py
import pytest

from hpctrain.checkpoint.hf_config import from_hf_config
from hpctrain.checkpoint.sharded import CheckpointError, read_full_state, read_manifest
from hpctrain.checkpoint.ckpt_commands import reshard
from hpctrain.config import ConfigError, load_config
from hpctrain.data.dataset import read_info
from hpctrain.data.tokenizers import HFTokenizer
from hpctrain.errors import DataError
from hpctrain.model.shape import GPTConfig
from tests.helpers import (HUGE_ELEMENTS, ReadSpy, crafted_checkpoint, hpctrain_cmd,
                           launcher,
                           mpiexec, save_tokenizer)

SMALL_MODEL = GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=8, block_size=8).shape()
ADDRESS_SPACE_LIMIT = 6 << 30
"""A third of what the crafted shard declares: reading it whole cannot pass under this."""


# ------------------------------------------------------------ a shard that is not stored

def test_a_crafted_shard_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """In this process the shard declares 200 MB, not 18.6 GiB: were the check gone,
    the read would fill it here (the command-line tests below take the big one under
    an address-space limit)."""
    ckpt = crafted_checkpoint(tmp_path / "step_000005", SMALL_MODEL, elements=50_000_000)
    spy = ReadSpy(monkeypatch)
    with pytest.raises(CheckpointError, match=r"dataset param/wte.weight declares "
                                              r"200,000,000 bytes .* but the file stores 0 "
                                              r"of them; the shard is damaged") as e:
        read_full_state(read_manifest(ckpt))
    assert "\n" not in str(e.value)
    assert "/param/wte.weight" not in spy.names


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def _run_limited(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` (and every process it starts) under ``ADDRESS_SPACE_LIMIT``."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **launcher().env(), "OMP_NUM_THREADS": "1"},
                          preexec_fn=_limit_address_space)


def _assert_one_line_refusal(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert errors and all("declares 20,000,000,000 bytes" in line for line in errors)
    assert "Traceback" not in p.stderr and "MemoryError" not in p.stderr


@pytest.mark.slow  # starts processes
def test_the_crafted_11kb_shard_fails_fast_from_the_command_line(tmp_path):
    """``ckpt inspect --verify`` reads every dataset: under an address-space limit a
    third of the 18.6 GiB declared, an allocation of it would end in a MemoryError
    traceback; the check answers with one line and exit 2, in seconds."""
    ckpt = crafted_checkpoint(tmp_path / "step_000005", SMALL_MODEL)
    assert (ckpt / "rank_00000.h5").stat().st_size < 16 << 10
    p = _run_limited(hpctrain_cmd("ckpt", "inspect", "--verify", str(ckpt)), 120)
    _assert_one_line_refusal(p)  # an allocation of it would not end within the limit


@pytest.mark.slow
def test_resuming_the_crafted_shard_at_2_ranks_fails_on_every_rank_without_allocating(
        dataset_path, tmp_path):
    """What every rank of a job does with it: each reads the whole state to reshard
    (the checkpoint is of 1 rank), and each refuses it from its declaration."""
    overrides = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32",
                 "--model.block_size=16", f"--data.path={dataset_path}"]
    model = load_config("default", overrides).model.to_gpt(read_info(dataset_path)
                                                           .vocab_size).shape()
    ckpt = crafted_checkpoint(tmp_path / "step_000005", model)
    p = _run_limited(mpiexec(2, *hpctrain_cmd(
        "train", "default", *overrides, f"--train.out_dir={tmp_path / 'run'}",
        f"--train.resume={ckpt}", "--train.progress=false")), 300)
    _assert_one_line_refusal(p)


def test_zero_moments_of_imported_weights_still_read(tmp_path):
    """The one dataset stored as nothing: a never-written Adam moment beside a parameter
    of its shape that is stored whole (``ckpt import``'s checkpoints)."""
    import torch

    from hpctrain.checkpoint.weights import save_weights
    from hpctrain.model.gpt import GPT

    params = {n: p.detach() for n, p in GPT(GPTConfig(**SMALL_MODEL)).named_parameters()}
    out = save_weights(tmp_path / "imported", params, SMALL_MODEL, tokenizer=None,
                       note={"from": "test"})
    full = read_full_state(read_manifest(out))
    assert all(torch.equal(full[n]["param"], p) and not full[n]["exp_avg_sq"].any()
               for n, p in params.items())


def test_a_never_written_moment_beside_an_unwritten_parameter_is_refused(tmp_path):
    """The exception for zero moments holds only next to a parameter stored whole."""
    ckpt = crafted_checkpoint(tmp_path / "step_000005", SMALL_MODEL, elements=1000)
    m = read_manifest(ckpt)
    with pytest.raises(CheckpointError, match="param/wte.weight declares 4,000 bytes"):
        read_full_state(m)
    with pytest.raises(CheckpointError, match="exp_avg/wte.weight declares 4,000 bytes"):
        read_full_state(m, ("exp_avg",))


def test_a_checksum_table_declared_but_never_written_is_refused(dataset_path, tmp_path,
                                                                 monkeypatch):
    """The right shape, never written: a dataset header is held to what is stored."""
    bad = tmp_path / "bad.h5"
    shutil.copy(dataset_path, bad)
    with h5py.File(bad, "r+") as f:
        shape, block_bytes = f["crc32/val"].shape, f["crc32/val"].attrs["block_bytes"]
        del f["crc32/val"]
        f.create_dataset("crc32/val", shape=shape, dtype="u4", chunks=True)
        f["crc32/val"].attrs["block_bytes"] = block_bytes
    spy = ReadSpy(monkeypatch)
    with pytest.raises(DataError, match=r"crc32/val declares 4 bytes .* stores 0 of them; "
                                        r"the file is corrupt"):
        read_info(bad)
    assert "/crc32/val" not in spy.names


def test_a_token_file_with_an_absurd_vocabulary_is_refused(dataset_path, tmp_path):
    bad = tmp_path / "bad.h5"
    shutil.copy(dataset_path, bad)
    with h5py.File(bad, "r+") as f:
        meta = json.loads(f.attrs["tokenizer"])
        f.attrs["tokenizer"] = json.dumps({**meta, "vocab_size": 1 << 40})
    with pytest.raises(DataError, match=r"vocab_size is 1099511627776, not a whole number "
                                        r"in \[1, 16777216\]"):
        read_info(bad)


# ------------------------------------------------------ numbers from configs and options

@pytest.mark.parametrize("option,message", [
    ("--model.n_layer=1000000000", r"n_layer is 1000000000, not a whole number in "
                                   r"\[1, 16384\]"),
    ("--model.vocab_size=1099511627776", r"vocab_size is 1099511627776"),
    ("--model.block_size=100000000", r"block_size is 100000000"),
    ("--train.batch_size=100000000000", r"more than 4294967296 tokens per step"),
    ("--train.max_iters=9999999999999999", r"train.max_iters must be at most 1099511627776"),
    ("--train.sample_tokens=100000000", r"train.sample_tokens must be in \[0, 16777216\]"),
])
def test_absurd_sizes_on_the_command_line_are_refused(option, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", [option])


@pytest.mark.parametrize("scaling", ["linear:nan", "linear:inf", "llama3:8:1:4:nan",
                                     "llama3:8:1:inf:8192"])
def test_a_nan_or_infinite_rope_scaling_is_refused(scaling):
    with pytest.raises(ConfigError, match="rope_scaling .* finite positive numbers"):
        load_config("llama-tiny", [f"--model.rope_scaling={scaling}"])


GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
        "n_layer": 12, "n_head": 12}
LLAMA = {"model_type": "llama", "vocab_size": 128256, "max_position_embeddings": 8192,
         "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8}


@pytest.mark.parametrize("base,change,message", [
    (GPT2, {"n_layer": 10**9}, r"n_layer is 1000000000, not a whole number in \[1, 16384\]"),
    (GPT2, {"vocab_size": 1 << 40}, r"vocab_size is 1099511627776"),
    (GPT2, {"layer_norm_epsilon": math.nan}, r"layer_norm_epsilon is nan, not a finite"),
    (LLAMA, {"rms_norm_eps": math.inf}, r"rms_norm_eps is inf, not a finite"),
    (LLAMA, {"rope_theta": math.nan}, r"rope_theta is nan, not a finite"),
    (LLAMA, {"rope_scaling": {"rope_type": "linear", "factor": math.nan}}, r"finite positive"),
    (LLAMA, {"num_hidden_layers": True}, r"num_hidden_layers is True"),
])
def test_an_imported_config_with_absurd_or_nan_numbers_is_refused(base, change, message):
    """``config.json`` parses NaN and Infinity (Python's json does): each is refused,
    naming the key, before a name table or a model is built from it."""
    config = json.loads(json.dumps({**base, **change}))
    with pytest.raises(ValueError, match=message):
        from_hf_config(config, bias=True)


def test_a_recorded_tokenizer_with_an_absurd_vocabulary_is_refused():
    import base64
    import hashlib
    import zlib

    text = "{}"
    meta = {"name": "hf", "vocab_size": 1 << 40, "sha256": hashlib.sha256(text.encode())
            .hexdigest(), "json_zlib": base64.b64encode(zlib.compress(text.encode())).decode()}
    with pytest.raises(DataError, match=r"vocab_size is 1099511627776, not a whole number"):
        HFTokenizer.from_meta(meta)


@pytest.mark.hf
def test_a_tokenizer_file_with_an_absurd_id_is_refused(tmp_path):
    save_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    doc = json.loads(path.read_text())
    doc["added_tokens"].append({**doc["added_tokens"][0], "id": 1 << 40,
                                "content": "<|far|>"})
    path.write_text(json.dumps(doc))
    # refused by our bound, or (tokenizers releases whose ids are u32) by the package
    # itself, as one DataError that names the file either way
    with pytest.raises(DataError, match=r"largest token id \+ 1 is 1099511627777|"
                                        r"not a tokenizer.json the tokenizers package reads"):
        HFTokenizer.from_file(tmp_path)


@pytest.mark.parametrize("kwargs,message", [
    ({"world": 10**9}, r"--world is 1000000000, not a whole number in \[1, 1048576\]"),
    ({"world": 0}, r"--world is 0"),
    ({"world": 2, "bucket_mb": math.nan}, r"--bucket-mb is nan, not a finite number"),
    ({"world": 2, "first_bucket_mb": math.inf}, r"--first-bucket-mb is inf"),
])
def test_reshard_refuses_an_absurd_world_before_reading_anything(tmp_path, monkeypatch,
                                                                  kwargs, message):
    ckpt = crafted_checkpoint(tmp_path / "step_000005", SMALL_MODEL)
    spy = ReadSpy(monkeypatch)
    with pytest.raises(CheckpointError, match=message):
        reshard(ckpt, tmp_path / "out", zero=1, **kwargs)
    assert spy.names == [] and not (tmp_path / "out").exists()


def test_sample_numbers_are_bounded_before_generating():
    from hpctrain.data.tokenizers import ByteTokenizer
    from hpctrain.errors import UserError
    from hpctrain.model.gpt import GPT

    model = GPT(GPTConfig(**SMALL_MODEL))
    for kwargs in ({"n_tokens": 10**12}, {"n_tokens": 1, "temperature": math.nan}):
        n = kwargs.pop("n_tokens")
        with pytest.raises(UserError, match="not a whole number|not a finite number"):
            model.complete(ByteTokenizer(), "a", n, **kwargs)


def test_the_crafted_shard_is_small_and_consistent(tmp_path):
    """The builder itself: a manifest that validates and a shard of about 11 KB."""
    ckpt = crafted_checkpoint(tmp_path / "c", SMALL_MODEL)
    assert read_manifest(ckpt).data["index"]["params"]["wte.weight"] == [HUGE_ELEMENTS]
    assert 4 << 10 < (ckpt / "rank_00000.h5").stat().st_size < 16 << 10
