"""Config: recipes, overrides, and validation messages that name the fix (no MPI)."""

import re
import pytest

from hpctrain.config import (Config, build_config, check_layout, config_from_dict, load_config,
                             parse_overrides, recipe_names)
from hpctrain.errors import ConfigError


def test_builtin_recipes_load_and_match_nanogpt_cpu_config():
    assert {"default", "shakespeare-char"} <= set(recipe_names())
    cfg = load_config("shakespeare-char")
    m, o, t = cfg.model, cfg.optim, cfg.train
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.dropout) == (4, 4, 128, 64, 0.0)
    assert (t.batch_size, t.max_iters) == (12, 2000)
    assert (o.lr, o.min_lr, o.warmup_iters, o.lr_decay_iters) == (1e-3, 1e-4, 100, 2000)
    assert (o.beta2, o.weight_decay, o.grad_clip) == (0.99, 0.1, 1.0)
    load_config("default")


def test_gpt2_124m_recipe_builds_gpt2_for_gpus():
    """GPT-2 124M in bf16 with compiled blocks and a padded vocabulary; it builds (on
    the meta device: no memory) and its batch splits for the example job scripts."""
    import torch

    from hpctrain.model.gpt import GPT

    cfg = load_config("gpt2-124m")
    m, t = cfg.model, cfg.train
    gpt = m.to_gpt(50257)  # the vocabulary of a GPT-2 BPE dataset
    assert (gpt.n_layer, gpt.n_head, gpt.n_embd, gpt.block_size) == (12, 12, 768, 1024)
    assert gpt.padded_vocab_size == 50304
    assert (t.dtype, t.compile, t.tf32, m.recompute) == ("bf16", True, True, "none")
    with torch.device("meta"):
        model = GPT(gpt)
    assert model.wte.weight.shape == (50304, 768)
    total = sum(p.numel() for p in model.parameters())
    assert total == gpt.num_params(non_embedding=False) and round(total / 1e6) == 124
    assert t.batch_size * m.block_size == 491520  # nanoGPT's ~0.5M tokens per step
    # jobscripts/generate.sh: Polaris 2 nodes x 4, Aurora 1 node x 12 tiles; 12 rows each
    for ranks, overrides in ((8, ["--parallel.micro_batches=5"]),
                             (12, ["--train.batch_size=576", "--parallel.micro_batches=4"])):
        job = load_config("gpt2-124m", overrides)
        check_layout(job, ranks)
        assert job.train.batch_size // (ranks * job.parallel.micro_batches) == 12


def test_llama_1b_recipe_builds_llama_3_2_1b_on_gpt2_tokens():
    """Llama 3.2 1B's shape on GPT-2's vocabulary (tied head, grouped-query attention),
    bf16 and compiled, about 0.5M tokens a step: it builds on the meta device with the
    planner's llama3.2-1b preset's blocks, its batch splits over 8 GPUs, and its options
    on a tiny shape train a step on the CPU."""
    import math

    import torch

    from hpctrain.model.gpt import GPT
    from hpctrain.scaling.models import preset_shape

    cfg = load_config("llama-1b")
    m, t = cfg.model, cfg.train
    gpt = m.to_gpt(50257)
    assert (gpt.arch, gpt.n_layer, gpt.n_embd, gpt.n_head, gpt.n_kv_head, gpt.ffn_hidden) == (
        "llama", 16, 2048, 32, 8, 8192)
    assert (gpt.rope_theta, gpt.norm_eps, gpt.tie_embeddings) == (500000.0, 1e-5, True)
    assert (t.dtype, t.compile, m.block_size, gpt.padded_vocab_size) == ("bf16", True, 2048,
                                                                         50304)
    with torch.device("meta"):
        model = GPT(gpt)
    assert model.lm_head.weight is model.wte.weight
    total = sum(p.numel() for p in model.parameters())
    preset = preset_shape("llama3.2-1b", vocab_size=50257, vocab_multiple=64, block_size=2048)
    assert total == gpt.num_params(non_embedding=False) == preset.params
    assert round(total / 1e9, 2) == 1.08  # Llama 3.2 1B's 1.24B less 77,952 vocabulary rows
    assert preset_shape("llama3.2-1b").params == 1_235_814_400  # Meta's checkpoint
    assert t.batch_size * m.block_size == 524288
    job = load_config("llama-1b", ["--parallel.micro_batches=4"])
    check_layout(job, 8)
    assert job.train.batch_size // (8 * job.parallel.micro_batches) == 8  # as on one GPU
    tiny = load_config("llama-1b", ["--model.n_layer=2", "--model.n_embd=64",
                                    "--model.n_head=4", "--model.n_kv_head=2",
                                    "--model.ffn_hidden=128", "--model.block_size=32"])
    torch.manual_seed(0)
    small = GPT(tiny.model.to_gpt(50257))
    idx = torch.randint(0, 50257, (2, 32))
    loss = small(idx, torch.roll(idx, -1, 1))
    loss.backward()
    assert abs(loss.item() - math.log(50304)) < 1.0  # near uniform over the padded rows
    assert small.wte.weight.grad is not None and torch.isfinite(small.wte.weight.grad).all()


def test_overrides_are_typed_in_both_spellings():
    cfg = load_config("default", ["--train.max_iters=7", "--model.bias", "true",
                                  "--optim.lr=5e-4", "--train.out_dir", "x/y"])
    assert cfg.train.max_iters == 7 and cfg.model.bias is True
    assert cfg.optim.lr == 5e-4 and cfg.train.out_dir == "x/y"


def test_an_on_off_or_path_option_takes_a_toml_boolean_in_a_recipe():
    recipe = {"train": {"tensorboard": True}}
    assert build_config(recipe).train.tensorboard == "true"
    assert build_config({"train": {"tensorboard": False}}).train.tensorboard == "false"
    assert build_config({"train": {"tensorboard": "tb"}}).train.tensorboard == "tb"
    with pytest.raises(ConfigError, match=r"tensorboard expects true, false or a path, got 3"):
        build_config({"train": {"tensorboard": 3}})
    with pytest.raises(ConfigError, match=r"out_dir expects str, got True"):
        build_config({"train": {"out_dir": True}})  # a plain text option does not


def test_unknown_option_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"did you mean --train.max_iters\?"):
        load_config("default", ["--train.max_iter=5"])


@pytest.mark.parametrize("args, message", [
    (["--train.max_iters=ten"], "--train.max_iters expects int"),
    (["--model.n_embd=100", "--model.n_head=3"], "must be a multiple of model.n_head"),
    (["--optim.schedule=linear"], "not one of cosine, wsd, constant"),
    (["--optim.min_lr=1"], r"optim.min_lr must be in \[0, optim.lr\]"),
    (["--train.batch_size=0"], "train.batch_size must be at least 1"),
    (["train.max_iters=5"], "options look like --section.key=value"),
    (["--train.max_iters"], "needs a value"),
    (["--comm.transport=shm", "--parallel.zero=1"], "use --comm.transport=auto or mpi"),
    (["--comm.transport=shm", "--train.dtype=bf16"], "use --comm.transport=auto or mpi"),
    (["--comm.transport=ring"], "not one of auto, mpi, shm, xccl"),
    (["--parallel.allreduce=shm", "--comm.collectives=xccl"],
     "--comm.collectives=xccl and --parallel.allreduce=shm disagree; give --comm.transport"),
    (["--model.recompute=full"], "model.recompute='full' is not one of none, selective, block"),
    (["--model.recompute_every=-1"], "model.recompute_every must be at least 0, not -1"),
    (["--model.recompute=block", "--model.recompute_every=2"],
     "recompute='block' already recomputes every block: set recompute_every=0"),
    (["--model.vocab_multiple=0"], "model.vocab_multiple must be at least 1, not 0"),
    (["--train.compile=maybe"], "--train.compile expects bool"),
    (["--train.tf32=2"], "--train.tf32 expects bool"),
    (["--train.profile=0"], "takes a step or a range of steps, e.g. 20 or 20-22"),
    (["--train.profile=5-3"], "the first not above the last"),
    (["--train.profile=ten"], "takes a step or a range of steps"),
    (["--train.profile=1-21"], "names 21 steps; at most 20"),
    (["--train.fp8=true"], "add --train.dtype=bf16"),
])
def test_bad_values_name_the_fix(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", args)


def test_unknown_recipe_lists_the_builtin_ones(tmp_path):
    with pytest.raises(ConfigError,
                       match="built-in recipes: default, gpt2-124m, llama-1b, llama-tiny, llama3-8b, "
                             "shakespeare-char"):
        load_config("no-such-recipe")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))
    bad.write_text("[modle]\nn_layer = 2\n")
    with pytest.raises(ConfigError, match=r"unknown section \[modle\]"):
        load_config(str(bad))


@pytest.mark.parametrize("content, message", [
    (b"\xef\x00\xff garbage", "is not UTF-8 text"),
    (b"a = " + b"[" * 10_000 + b"]" * 10_000, "nests its values deeper"),
    (b"# " + b"x" * (1 << 20) + b"\n", "more than any recipe"),
], ids=["binary", "deep", "huge"])
def test_a_recipe_file_that_is_no_recipe_is_one_config_error(tmp_path, content, message):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_config(str(bad))


def test_batch_must_split_over_ranks_and_micro_batches():
    cfg = build_config({"train": {"batch_size": 12}, "parallel": {"micro_batches": 2}})
    check_layout(cfg, 2)  # 12 = 2 ranks x 2 micro x 3 rows
    with pytest.raises(ConfigError, match="use a multiple of 8 .*--train.batch_size=8 or 16"):
        check_layout(cfg, 4)


def test_config_round_trips_through_a_dict():
    cfg = load_config("shakespeare-char", ["--train.seed=3"])
    again = build_config(cfg.to_dict())
    assert again == cfg and isinstance(again, Config)


def test_parse_overrides():
    assert parse_overrides(["--a.b=1", "--c.d", "x=y"]) == {"a.b": "1", "c.d": "x=y"}


def test_to_gpt_maps_every_model_field():
    """One mapping from the config to the model: a field added to one side only fails."""
    import dataclasses

    from hpctrain.config import ModelConfig
    from hpctrain.model.shape import GPTConfig

    names = [f.name for f in dataclasses.fields(ModelConfig)]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(GPTConfig))
    # A value per field that no default has, so a dropped field shows.
    m = ModelConfig(n_layer=3, n_head=4, n_embd=24, block_size=17, vocab_size=0,
                    dropout=0.25, bias=True, vocab_multiple=8, recompute="block",
                    arch="llama", n_kv_head=2, ffn_hidden=40, rope_theta=500.0,
                    rope_scaling="linear:2", norm_eps=1e-6, tie_embeddings=False,
                    loss_chunk=5)
    gpt = m.to_gpt(vocab_size=71)
    want = {**dataclasses.asdict(m), "vocab_size": 71}
    assert dataclasses.asdict(gpt) == want
    # 0 means the architecture's default, resolved in the model's shape
    resolved = ModelConfig(arch="llama", n_embd=96, n_head=4).to_gpt(71)
    assert (resolved.n_kv_head, resolved.ffn_hidden) == (4, 256)
    assert ModelConfig(vocab_size=33).to_gpt(71).vocab_size == 33  # the config's wins
    with pytest.raises(ConfigError, match="set --model.vocab_size"):
        ModelConfig().to_gpt()


@pytest.mark.parametrize("overrides,message", [
    ({"arch": "llama", "n_kv_head": 3}, "multiple of n_kv_head=3"),
    ({"arch": "llama", "rope_scaling": "cubic"}, "rope_scaling 'cubic'"),
    ({"n_kv_head": 2}, "needs arch=llama"),
    ({"arch": "llama", "n_embd": 20, "n_head": 4}, "must be even"),
    ({"arch": "mamba"}, "model.arch='mamba' is not one of gpt, llama"),
])
def test_bad_model_shapes_name_the_option(overrides, message):
    from hpctrain.config import ModelConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig(**overrides)


def test_a_deprecated_option_name_still_works_with_one_line(capsys):
    cfg = load_config("default", ["--data.stage_dir=/local/scratch"])
    assert cfg.data.local_copy_dir == "/local/scratch"
    assert capsys.readouterr().err == ("warning: --data.stage_dir is deprecated (removed in "
                                       "the next release): --data.stage_dir -> "
                                       "--data.local_copy_dir\n")


@pytest.mark.parametrize("old, new", [
    ("--comm.collectives=xccl", "xccl"), ("--comm.collectives=mpi", "mpi"),
    ("--parallel.allreduce=shm", "shm"), ("--parallel.allreduce=mpi", "mpi"),
    ("--parallel.allreduce=auto", "auto")])
def test_deprecated_transport_options_still_work_and_say_their_new_name_once(old, new, capsys):
    cfg = load_config("default", [old])
    assert cfg.comm.transport == new
    name = old.split("=")[0]
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {name} is deprecated (removed in the next release): "
        f"{name} -> --comm.transport"]
    # a saved config (checkpoint manifests, records) written with the old name reads
    # silently, and the new name given beside an old one wins
    section, key = name[2:].split(".")
    assert config_from_dict({section: {key: new}}).comm.transport == new
    assert load_config("default", [old, "--comm.transport=auto"]).comm.transport == "auto"
    assert capsys.readouterr().err.count("deprecated") == 1


@pytest.mark.parametrize("transport, collectives, allreduce", [
    ("auto", "auto", "auto"), ("mpi", "mpi", "mpi"), ("shm", "mpi", "shm"),
    ("xccl", "xccl", "auto")])
def test_one_transport_option_sets_the_world_and_the_gradient_sums(transport, collectives,
                                                                   allreduce):
    comm = load_config("default", [f"--comm.transport={transport}"]).comm
    assert (comm.collectives, comm.allreduce) == (collectives, allreduce)


@pytest.mark.parametrize("sections,message", [
    ({"model": {"block_size": 12}}, "block_size=12 does not cut into 2 x --parallel.cp = 8 "
                                    "equal chunks; use a block_size that is a multiple of 8"),
    ({"model": {"dropout": 0.1}}, "needs model.dropout=0"),
    ({"train": {"compile": True}}, "runs without --train.compile"),
    ({"comm": {"transport": "shm"}}, "use --comm.transport=auto or mpi"),
])
def test_context_parallel_refuses_what_it_does_not_do_with_the_fix(sections, message):
    with pytest.raises(ConfigError, match=message):
        build_config({**sections, "parallel": {"cp": 4}})


def test_context_parallel_groups_must_divide_the_ranks_over_tp():
    cfg = build_config({"train": {"batch_size": 8}, "parallel": {"cp": 2, "tp": 2}})
    check_layout(cfg, 8)  # dp = 2 x cp = 2 x tp = 2
    with pytest.raises(ConfigError, match=r"6 rank\(s\) cannot form context-parallel groups of "
                                          r"--parallel.cp=2 \(x tp=2\): --parallel.cp must "
                                          "divide"):
        check_layout(cfg, 6)  # 3 tensor-parallel groups
