"""The trainer in one process: equal to the plain PyTorch loop, accumulation, outputs."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.checkpoint.single_file import load_single_file
from hpctrain.errors import ConfigError
from hpctrain.train.result import logs_step
from hpctrain.train.timing import PARTS_OF_BACKWARD, PHASES
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, fit_against_reference, SGD, tiny_config
from tests.reference import plain_model_config


def _train(cfg):
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    return trainer, trainer.fit()


def test_a_record_follows_each_log_interval_the_last_step_and_an_eval_save_or_stop():
    t = SimpleNamespace(log_interval=5, max_iters=12)
    quiet = {"evaluates": False, "saves": False, "stops": False}
    assert [d for d in range(1, 13) if logs_step(d, t, **quiet)] == [5, 10, 12]
    for reason in quiet:  # each alone makes step 3 write its record
        assert logs_step(3, t, **{**quiet, reason: True}), reason


def test_trainer_matches_the_plain_pytorch_loop(dataset_path, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path)
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    result, _ = fit_against_reference(trainer, cfg)
    assert result.losses[-1] < result.losses[0] - 0.3  # it learns


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_trainer_with_plain_sgd_matches_the_plain_loop(dataset_path, tmp_path, micro_batches):
    """SGD, no clipping: forgetting to divide by the micro-batch count doubles the step."""
    cfg = tiny_config(dataset_path, tmp_path, **SGD, **{"parallel.micro_batches": micro_batches})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    fit_against_reference(trainer, cfg)


def test_gradient_accumulation_equals_the_full_batch(dataset_path, tmp_path):
    _, full = _train(tiny_config(dataset_path, tmp_path / "a"))
    _, accum = _train(tiny_config(dataset_path, tmp_path / "b", **{"parallel.micro_batches": 4}))
    np.testing.assert_allclose(accum.losses, full.losses, atol=1e-5, rtol=0)


def test_outputs_metrics_checkpoint_and_sample(dataset_path, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path, **{
        "train.eval_interval": 10, "train.final_eval": True, "train.save_checkpoint": True,
        "train.sample_tokens": 20, "train.eval_iters": 2, "train.max_iters": 20})
    trainer, result = _train(cfg)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [5, 10, 15, 20]
    for r in logged:
        assert {"step", "loss", "lr", "tokens_per_s"} <= r.keys() and r["tokens_per_s"] > 0
        assert r["loss"] == pytest.approx(result.losses[r["step"] - 1])
    assert [r["step"] for r in logged if "val_loss" in r] == [10, 20]
    assert records[-1]["final_val_loss"] == pytest.approx(result.final_val_loss)
    assert 0 < result.final_val_loss < 6
    assert len((tmp_path / "sample.txt").read_text()) >= 20
    ckpt = load_single_file(tmp_path)
    assert ckpt.step == 20 and ckpt.config == cfg.to_dict()
    for name, p in trainer.model.named_parameters():
        np.testing.assert_array_equal(ckpt.model[name], p.detach().numpy())
    assert set(ckpt.optim["wte.weight"]) == {"step", "exp_avg", "exp_avg_sq"}


def test_summary_breaks_each_step_into_phases(dataset_path, tmp_path):
    """summary.json's ``timing.phases_ms``: every phase, which add up to the step (hooks
    are a part of backward); forward, backward and the optimizer take time, a single
    rank neither waits nor reduces."""
    _, result = _train(tiny_config(dataset_path, tmp_path, **{"train.max_iters": 20}))
    timing = json.loads((tmp_path / "summary.json").read_text())["timing"]
    phases = timing["phases_ms"]
    assert set(phases) == {*PHASES, "step"}
    assert min(phases["forward"], phases["backward"], phases["optimizer"]) > 0
    assert phases["wait"] == phases["hooks"] == phases["bubble"] == 0
    assert phases["step"] == pytest.approx(timing["step_ms_median"], rel=1e-9)
    # No time is counted twice: in every step the measured phases leave a rest ("other")
    # of at least zero. (Medians of the phases need not add up to the median step, least
    # of all on a loaded machine, so the sum is checked step by step.)
    for step in result.phases:
        measured = sum(v for k, v in step.items()
                       if k not in (*PARTS_OF_BACKWARD, "other", "step"))
        assert measured <= step["step"] and step["other"] >= 0
        assert step["hooks"] <= step["backward"]


def test_batch_that_does_not_split_is_refused(dataset_path, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path, **{"train.batch_size": 6,
                                                 "parallel.micro_batches": 4})
    with pytest.raises(ConfigError, match="use a multiple of 4"):
        _train(cfg)


def test_recompute_matches_the_plain_model(dataset_path, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path, **{"model.recompute": "block",
                                                 "parallel.micro_batches": 2})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    assert all(block.recompute == "block" for block in trainer.model.h)
    fit_against_reference(trainer, plain_model_config(cfg))


def test_a_padded_vocabulary_trains_like_an_unpadded_one(dataset_path, tmp_path):
    """The default pads the 95-character vocabulary to 128 rows: the same losses as no
    padding, and the padded rows stay zero through AdamW's weight decay."""
    padded, result = _train(tiny_config(dataset_path, tmp_path / "a"))
    assert padded.gpt_cfg.vocab_size == 95 and padded.model.wte.weight.shape[0] == 128
    _, plain = _train(tiny_config(dataset_path, tmp_path / "b", **{"model.vocab_multiple": 1}))
    np.testing.assert_allclose(result.losses, plain.losses, atol=1e-6, rtol=0)
    assert not padded.model.wte.weight[95:].any()


def test_tf32_is_set_for_gpus_only():
    from hpctrain.parallel.parallelize import set_matmul_precision

    before = torch.get_float32_matmul_precision()
    assert before == "highest"
    assert not set_matmul_precision(torch.device("cpu"), True)  # a CPU rank: no change
    assert torch.get_float32_matmul_precision() == "highest"
    try:
        assert set_matmul_precision(torch.device("cuda", 0), True)
        assert torch.get_float32_matmul_precision() == "high"
        assert set_matmul_precision(torch.device("cuda", 0), False)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = True


@pytest.mark.slow
def test_compiled_blocks_match_the_plain_model(dataset_path, tmp_path):
    """torch.compile (inductor, C++ on this CPU) for every block, with recomputation:
    the same losses, gradients and parameters as the eager plain model, to round-off."""
    cfg = tiny_config(dataset_path, tmp_path, **{"train.compile": True,
                                                 "model.recompute": "block"})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    assert all(block.compiled_body is not None for block in trainer.model.h)
    fit_against_reference(trainer, plain_model_config(cfg))


def test_the_validation_estimate_is_the_same_in_smaller_passes(dataset_path, tmp_path,
                                                               monkeypatch):
    """A batch larger than ``FULL_EVAL_ROWS`` is evaluated in passes of at most that many
    rows (a GPU's memory), weighted into the same batch mean."""
    import hpctrain.train.evaluate as evaluate

    trainer = Trainer(tiny_config(dataset_path, tmp_path, **{"train.eval_iters": 2}),
                      cpu_world(MPI.COMM_SELF), verbose=False)
    whole = trainer.evaluator.estimate()
    rows = []
    forward_loss = trainer.runner.forward_loss
    monkeypatch.setattr(trainer.runner, "forward_loss",
                        lambda x, y: rows.append(len(x)) or forward_loss(x, y))
    monkeypatch.setattr(evaluate, "FULL_EVAL_ROWS", 3)
    assert trainer.evaluator.estimate() == pytest.approx(whole, rel=1e-6, abs=0)
    assert rows == [3, 3, 2] * 2  # 8 rows per batch, 2 batches
    trainer.close()
