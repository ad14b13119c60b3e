"""``--train.init_from``: a new run from a checkpoint's weights, in one process (the MPI
layouts are ``test_init_from_mpi.py``)."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.checkpoint.sharded import CheckpointError
from hpctrain.checkpoint.weights import load_weights
from hpctrain.config import ConfigError
from hpctrain.data.dataset import TokenDataset
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, LLAMA, random_weights, tiny_config, weights_checkpoint
from tests.reference import plain_torch_run

ARCHS = {"gpt": {"model.bias": True}, "llama": LLAMA}


def _trainer(cfg):
    return Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)


def _data(path):
    ds = TokenDataset(str(path))
    try:
        return ds.vocab_size, ds.tokenizer.meta()
    finally:
        ds.close()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_run_from_imported_weights_is_the_plain_loop_from_those_weights(dataset_path,
                                                                          tmp_path, arch):
    """The checkpoint records an unpadded vocabulary, the run pads to 64 (the default):
    every step's loss equals a plain AdamW loop that starts from the same weights at step
    0 with a fresh optimizer and schedule, so the first loss is the weights' own."""
    cfg = tiny_config(dataset_path, tmp_path / "run", **ARCHS[arch], **{"train.max_iters": 4})
    vocab, tokenizer = _data(dataset_path)
    gpt_cfg = cfg.model.to_gpt(vocab)
    assert gpt_cfg.padded_vocab_size > vocab
    weights = random_weights(gpt_cfg)
    ckpt = weights_checkpoint(tmp_path / "ckpt", weights, gpt_cfg, tokenizer)
    run = tiny_config(dataset_path, tmp_path / "run", **ARCHS[arch],
                      **{"train.max_iters": 4, "train.init_from": str(ckpt)})
    trainer = _trainer(run)
    assert trainer.start.step == 0
    result = trainer.fit()
    ref = plain_torch_run(cfg, init=weights)
    np.testing.assert_allclose(result.losses, ref.losses, atol=1e-5, rtol=0)
    fresh = plain_torch_run(cfg)  # the seed's own initialization: another first loss
    assert abs(fresh.losses[0] - ref.losses[0]) > 1e-3


@pytest.fixture(scope="module")
def trained(dataset_path, tmp_path_factory):
    """A ZeRO-3 run of 5 steps: its sharded checkpoint and final.h5."""
    out = tmp_path_factory.mktemp("init-src")
    cfg = tiny_config(dataset_path, out, **{"parallel.zero": 3, "train.max_iters": 5,
                                            "train.save_checkpoint": True})
    _trainer(cfg).fit()
    return out


@pytest.mark.parametrize("source", ["checkpoints/step_000005", "final.h5", "."])
def test_init_from_a_trained_run_takes_its_weights_and_nothing_else(dataset_path, trained,
                                                                    tmp_path, source):
    """A sharded checkpoint of another layout, a final.h5, an out_dir: this plain data-
    parallel run holds the weights bit for bit, and its optimizer is a fresh AdamW."""
    params, _, _ = load_weights(trained / source)
    cfg = tiny_config(dataset_path, tmp_path / "run", **{
        "train.init_from": str(trained / source), "train.max_iters": 2})
    trainer = _trainer(cfg)
    assert trainer.start.step == 0
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.detach(), params[name], atol=0, rtol=0)
    state = trainer.engine.state_shards()
    assert state.step == 0
    assert all(not s[k].any() for s in state.params.values() for k in ("exp_avg", "exp_avg_sq"))
    assert len(trainer.fit().losses) == 2


def test_another_model_is_one_error_naming_the_options(dataset_path, trained, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path / "run", **{
        "train.init_from": str(trained), "model.n_layer": 3, "model.n_embd": 48})
    with pytest.raises(CheckpointError, match=r"n_layer=2 \(this run 3\).*run with "
                                              r"--model.n_layer=2 --model.n_embd=32 "
                                              r"--model.ffn_hidden=128$"):
        _trainer(cfg)


def test_data_of_another_tokenizer_is_refused(dataset_path, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path / "run")
    vocab, tokenizer = _data(dataset_path)
    gpt_cfg = cfg.model.to_gpt(vocab)
    other = {**tokenizer, "chars": tokenizer["chars"][::-1]}  # the same size, other ids
    ckpt = weights_checkpoint(tmp_path / "ckpt", random_weights(gpt_cfg), gpt_cfg, other)
    run = tiny_config(dataset_path, tmp_path / "run", **{"train.init_from": str(ckpt)})
    with pytest.raises(CheckpointError, match="same ids would mean other text; prepare"):
        _trainer(run)


def test_a_hugging_face_directory_is_sent_to_import(dataset_path, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    cfg = tiny_config(dataset_path, tmp_path / "run", **{"train.init_from": str(tmp_path / "hf")})
    with pytest.raises(CheckpointError, match="import it first: hpctrain ckpt import --from hf"):
        _trainer(cfg)


def test_resume_from_a_path_and_init_from_are_exclusive(dataset_path, tmp_path):
    with pytest.raises(ConfigError, match="give one of them"):
        tiny_config(dataset_path, tmp_path, **{"train.init_from": "a", "train.resume": "b"})


def test_with_resume_auto_a_requeued_run_continues(dataset_path, trained, tmp_path):
    """init_from with resume=auto: the first job starts from the weights, the same
    command again resumes its own checkpoint instead of starting over."""
    opts = {"train.init_from": str(trained), "train.resume": "auto",
            "train.save_checkpoint": True}
    first = _trainer(tiny_config(dataset_path, tmp_path, **opts, **{"train.max_iters": 3}))
    assert first.start.step == 0 and first.start.weights_from
    first.fit()
    again = _trainer(tiny_config(dataset_path, tmp_path, **opts, **{"train.max_iters": 5}))
    assert again.start.step == 3 and not again.start.weights_from
    assert len(again.fit().losses) == 2


def test_a_shorter_context_keeps_the_first_positions(dataset_path, trained, tmp_path):
    """GPT-2's learned positions: a run with a shorter block_size takes the first rows of
    the table, a longer one has none to take (Llama's rotary positions have no rows)."""
    params, _, _ = load_weights(trained)
    short = _trainer(tiny_config(dataset_path, tmp_path / "short", **{
        "train.init_from": str(trained), "model.block_size": 8}))
    torch.testing.assert_close(short.model.wpe.weight.detach(), params["wpe.weight"][:8],
                               atol=0, rtol=0)
    short.close()
    with pytest.raises(CheckpointError, match=r"block_size=16 \(this run 32\)"):
        _trainer(tiny_config(dataset_path, tmp_path / "long", **{
            "train.init_from": str(trained), "model.block_size": 32}))
