"""A config as a TOML recipe: ``--print-config`` and a run's ``config.toml`` reproduce
the run; ``train RECIPE --help`` shows the recipe's values."""

import json
import subprocess
import sys

import pytest
from mpi4py import MPI

from hpctrain.config import (RUN_CONFIG, build_config, load_config, recipe_names,
                             recipe_toml)
from hpctrain.config.loading import read_recipe
from hpctrain.output_paths import RUN_OUTPUTS
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _hpctrain(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_round_trips_through_its_toml(recipe):
    cfg = load_config(recipe, ["--train.max_iters=7", "--optim.lr=3e-4"])
    again = build_config(tomllib.loads(recipe_toml(cfg)), warn=False)
    assert again.to_dict() == cfg.to_dict()


def test_strings_that_need_escapes_round_trip(tmp_path):
    odd = 'a "quoted" \\ path\twith\x7f del, é and \U0001f600/x.h5'
    cfg = load_config("default", {"data.path": odd, "train.out_dir": str(tmp_path)})
    text = recipe_toml(cfg)
    assert tomllib.loads(text)["data"]["path"] == odd


def test_print_config_writes_a_recipe_that_trains_the_same_config(tmp_path):
    shown = _hpctrain("train", "default", "--train.max_iters=7", "--print-config")
    assert shown.returncode == 0, shown.stderr
    recipe = tmp_path / "saved.toml"
    recipe.write_text(shown.stdout)
    again = _hpctrain("train", str(recipe), "--print-config=json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == load_config("default", ["--train.max_iters=7"]).to_dict()


def test_help_with_a_recipe_shows_its_values_and_marks_what_sets_them():
    out = _hpctrain("train", "default", "--train.eval_iters=3", "--help")
    assert out.returncode == 0, out.stderr
    recipe = read_recipe("default")
    block = recipe["model"]["block_size"]
    lines = out.stdout.splitlines()
    line = next(x for x in lines if x.strip().startswith("--model.block_size="))
    assert line.strip().startswith(f"--model.block_size={block} ")
    assert "[set by the recipe; default 64]" in line
    line = next(x for x in lines if x.strip().startswith("--train.eval_iters="))
    assert line.strip().startswith("--train.eval_iters=3 ") and "set by the command line" in line
    line = next(x for x in lines if x.strip().startswith("--optim.beta1="))
    assert "set by" not in line  # a default stays unmarked


def test_a_run_folder_gets_a_config_toml_that_reproduces_it(dataset_path, tmp_path):
    assert RUN_CONFIG in RUN_OUTPUTS  # moved aside with the run's other outputs
    cfg = tiny_config(dataset_path, tmp_path / "run", **{"train.max_iters": 2})
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    saved = tmp_path / "run" / RUN_CONFIG
    assert build_config(tomllib.loads(saved.read_text()), warn=False).to_dict() == \
        cfg.to_dict()


def test_a_config_toml_of_the_users_own_in_the_run_folder_is_kept(dataset_path, tmp_path):
    """The user's recipe kept beside the run is neither an earlier run's output (the run
    starts without --train.overwrite) nor replaced."""
    cfg = tiny_config(dataset_path, tmp_path / "run", **{"train.max_iters": 2})
    mine = tmp_path / "run" / RUN_CONFIG
    mine.parent.mkdir()
    mine.write_text("[train]\nmax_iters = 2\n")
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    assert mine.read_text() == "[train]\nmax_iters = 2\n"
    assert (tmp_path / "run" / "summary.json").exists()
