"""Checkpoints against a hostile or unlucky filesystem: pruning by step, every kind of
save failure, leftovers of killed saves, damaged or crafted manifests, shards, ``latest``
files and final.h5, and file modes that follow the umask."""

import errno
import json
import os
import shutil
import stat

import h5py
import pytest
from mpi4py import MPI

import hpctrain.checkpoint.distributed as distributed
import hpctrain.checkpoint.sharded as sharded
from hpctrain.checkpoint.shard_file import crc32_of
from hpctrain.checkpoint.sharded import CheckpointError, read_manifest, shard_name
from hpctrain.checkpoint.single_file import load_single_file
from hpctrain.checkpoint.ckpt_commands import inspect
from hpctrain.errors import DataError, UserError
from hpctrain.train.trainer import Trainer
from tests.helpers import ReadSpy, cpu_world, tiny_config


def _cfg(data, out, **overrides):
    return tiny_config(data, out, **{"train.ckpt_interval": 10, "train.save_checkpoint": True,
                                     **overrides})


def _trainer(cfg):
    return Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)


def _fit(cfg):
    trainer = _trainer(cfg)
    return trainer, trainer.fit()


@pytest.fixture(scope="module")
def runs(dataset_path, tmp_path_factory):
    """A finished 10-step run per layout (replicated and ZeRO-2), each with
    checkpoints/step_000010 and final.h5; tests copy what they damage."""
    base = tmp_path_factory.mktemp("runs")
    for layout, zero in (("replicated", 0), ("zero", 2)):
        _fit(_cfg(dataset_path, base / layout, **{"parallel.zero": zero}))
    return base


def _copy_checkpoint(runs, layout, dst):
    return shutil.copytree(runs / layout / "checkpoints" / "step_000010", dst)


def _names(root):
    return sorted(p.name for p in root.iterdir())


# ------------------------------------------------------------------- 1. pruning by step

def test_pruning_orders_by_manifest_step_past_a_million(dataset_path, tmp_path):
    """``step_1000000`` sorts before ``step_999990`` by name: the new checkpoint must
    still be the one kept, and ``latest`` must name an existing directory."""
    trainer, _ = _fit(_cfg(dataset_path, tmp_path, **{"train.ckpt_keep": 1}))
    root = tmp_path / "checkpoints"
    trainer.saver.save(999990)
    trainer.saver.save(1000000)
    assert _names(root) == ["latest", "step_1000000"]
    assert (root / "latest").read_text().strip() == "step_1000000"
    assert read_manifest(tmp_path).step == 1000000


def test_pruning_keeps_the_new_save_below_older_higher_steps(dataset_path, tmp_path):
    """An out_dir holding higher steps (step_000020, step_000030 of an earlier run):
    a save at step 5 with keep=2 keeps itself and the highest other, and ``latest``
    names it. A directory with neither a manifest nor a step in its name is never
    deleted; one without a manifest goes by the number in its name."""
    trainer, _ = _fit(_cfg(dataset_path, tmp_path, **{"train.ckpt_keep": 2}))
    root = tmp_path / "checkpoints"
    for step in (20, 30):
        d = shutil.copytree(root / "step_000010", root / f"step_{step:06d}")
        manifest = json.loads((d / "manifest.json").read_text())
        (d / "manifest.json").write_text(json.dumps({**manifest, "step": step}))
    (root / "step_000007").mkdir()  # no manifest: step 7 by its name
    (root / "step_keepme").mkdir()  # no manifest, no number: not ours to delete
    trainer.saver.save(5)
    assert _names(root) == ["latest", "step_000005", "step_000030", "step_keepme"]
    assert (root / "latest").read_text().strip() == "step_000005"
    assert read_manifest(tmp_path).step == 5


# ------------------------------------------------------- 2. every save failure is clean

def _assert_previous_intact(out_dir):
    root = out_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000010"
    assert read_manifest(out_dir).step == 10
    assert not list(root.glob(".step_*")), "the temporary directory was left behind"
    assert not list(root.glob(".latest.*"))
    assert not (root / "step_000015").exists()


@pytest.mark.parametrize("error", [RuntimeError("Can't write data (file write failed)"),
                                   OSError(errno.ENOSPC, "No space left on device")],
                         ids=["h5py-RuntimeError", "ENOSPC"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_shard_write_failure_is_one_clean_error(dataset_path, tmp_path, monkeypatch, error,
                                                asynchronous):
    trainer, _ = _fit(_cfg(dataset_path, tmp_path))

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(distributed, "write_shard", fail)
    with pytest.raises(CheckpointError, match="saving checkpoint step 15 failed: rank 0") as e:
        trainer.saver.save(15, asynchronous=asynchronous)
        trainer.saver.finish_pending()
    assert "\n" not in str(e.value) and str(error.args[-1]) in str(e.value)
    _assert_previous_intact(tmp_path)


@pytest.mark.parametrize("target", ["write_synced", "publish", "chmod_as_created",
                                    "write_latest"])
def test_manifest_or_publish_failure_is_one_clean_error(dataset_path, tmp_path, monkeypatch,
                                                        target):
    """Rank 0 failing while it writes the manifest, renames the directory or writes
    ``latest``: the same one-line error, the temporary removed."""
    trainer, _ = _fit(_cfg(dataset_path, tmp_path))

    def fail(*args, **kwargs):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    if target == "write_synced":
        monkeypatch.setattr(distributed, "write_synced", fail)
    elif target == "publish":
        monkeypatch.setattr(distributed, "publish", fail)
    elif target == "chmod_as_created":
        monkeypatch.setattr(sharded, "chmod_as_created", fail)
    else:  # the manifest is written, the directory renamed, then latest fails
        real = sharded.write_synced
        monkeypatch.setattr(sharded, "write_synced", lambda path, text: fail()
                            if path.name.startswith(".latest.") else real(path, text))
    with pytest.raises(CheckpointError, match="rank 0, publishing: .*Disk quota exceeded"):
        trainer.saver.save(15)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000010"
    assert read_manifest(tmp_path).step == 10
    assert not list(root.glob(".step_*")) and not list(root.glob(".latest.*"))


def test_unwritable_checkpoint_root_is_one_clean_error(dataset_path, tmp_path, monkeypatch):
    trainer, _ = _fit(_cfg(dataset_path, tmp_path))

    def fail(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path))

    monkeypatch.setattr(distributed.tempfile, "mkdtemp", fail)
    with pytest.raises(CheckpointError, match="step 15 failed: rank 0: .*Permission denied"):
        trainer.saver.save(15)
    _assert_previous_intact(tmp_path)


# ------------------------------------------------------------- 3. orphaned temporaries

def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    root = tmp_path / "checkpoints"
    stale_dir = root / ".step_000100.k3j_x9ab.tmp"
    (stale_dir).mkdir(parents=True)
    (stale_dir / "rank_00000.h5").write_bytes(b"half")
    (root / ".latest.ab12cd_3").write_text("step_000100\n")
    keep = [root / "step_000090", root / ".step_abc.tmp", root / "notes.tmp",
            root / ".latest", root / "latest", root / ".step_000100.tmp.bak"]
    keep[0].mkdir()
    (keep[0] / "manifest.json").write_text("{}")
    for p in keep[1:]:
        p.write_text("x")
    removed = sharded.remove_stale_temporaries(root)
    assert sorted(removed) == sorted([stale_dir, root / ".latest.ab12cd_3"])
    assert sorted(root.iterdir()) == sorted(keep)
    assert sharded.remove_stale_temporaries(root) == []
    assert sharded.remove_stale_temporaries(tmp_path / "no-such-dir") == []


# ------------------------------------------------------------ 4. damaged manifests

def _bucket(m):
    return m["index"]["buckets"][0]


DAMAGES = {  # name: (layout, change to the manifest)
    "crc32 missing": ("zero", lambda m: m.pop("crc32")),
    "model missing": ("replicated", lambda m: m.pop("model")),
    "index missing": ("zero", lambda m: m.pop("index")),
    "model.n_embd a string": ("replicated", lambda m: m["model"].update(n_embd="32")),
    "layout unknown": ("zero", lambda m: m.update(layout="tensor-parallel")),
    "layout swapped": ("zero", lambda m: m.update(layout="replicated")),
    "world_size huge": ("zero", lambda m: m.update(world_size=1 << 40)),
    "world_size 0": ("replicated", lambda m: m.update(world_size=0)),
    "world_size beyond the shards": ("replicated", lambda m: m.update(world_size=3)),
    "step negative": ("zero", lambda m: m.update(step=-1)),
    "optimizer_step a string": ("zero", lambda m: m.update(optimizer_step="ten")),
    "shape negative": ("replicated",
                       lambda m: m["index"]["params"].update({"wte.weight": [-95, 32]})),
    "shape overflowing": ("replicated", lambda m: m["index"]["params"].update(
        {"wte.weight": [1 << 31, 1 << 31, 1 << 31]})),
    "shape not a list": ("replicated",
                         lambda m: m["index"]["params"].update({"wte.weight": 95})),
    "shape wrong": ("replicated",
                    lambda m: m["index"]["params"].update({"wte.weight": [95, 33]})),
    "owner rank beyond world": ("replicated", lambda m: m["index"].update(
        owners={"wte.weight": 5})),
    "bucket offset past the end": ("zero", lambda m: _bucket(m)["offsets"].__setitem__(
        -1, _bucket(m)["shard"])),
    "bucket shard too small": ("zero", lambda m: _bucket(m).update(shard=10)),
    "bucket shapes fewer than names": ("zero", lambda m: _bucket(m)["shapes"].pop()),
    "bucket shape wrong but fitting": ("zero",
                                       lambda m: _bucket(m)["shapes"].__setitem__(0, [31])),
    "bucket ranks beyond world": ("zero", lambda m: _bucket(m).update(ranks=[7])),
    "crc not a number": ("zero", lambda m: m["crc32"][shard_name(0)].update(
        {"rng/torch": "x"})),
    "not an object": ("zero", lambda m: m.update(_replace_with=[])),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_manifest_is_one_clean_error(runs, dataset_path, tmp_path, damage):
    layout, change = DAMAGES[damage]
    ckpt = _copy_checkpoint(runs, layout, tmp_path / "step_000010")
    mf = ckpt / "manifest.json"
    manifest = json.loads(mf.read_text())
    change(manifest)
    mf.write_text(json.dumps(manifest.get("_replace_with", manifest)))
    resume = _cfg(dataset_path, tmp_path / "again", **{"train.resume": str(ckpt),
                                                       "parallel.zero": 2})
    for attempt in (lambda: _fit(resume), lambda: inspect(ckpt, verify=True)):
        with pytest.raises(CheckpointError) as e:
            attempt()
        message = str(e.value)
        assert "\n" not in message
        assert str(ckpt) in message
        assert "older step_N directory" in message or "not an hpctrain" in message


def test_a_consistent_checkpoint_of_other_shapes_is_refused_at_load(runs, dataset_path,
                                                                    tmp_path):
    """Manifest, shard and CRCs agree on a shape the model does not have (the model keys
    still match): refused before any parameter is overwritten."""
    ckpt = _copy_checkpoint(runs, "replicated", tmp_path / "step_000010")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    crcs = manifest["crc32"][shard_name(0)]
    with h5py.File(ckpt / shard_name(0), "r+") as f:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            a = f[f"{k}/ln_f.weight"][()].reshape(16, 2)
            del f[f"{k}/ln_f.weight"]
            f[f"{k}/ln_f.weight"] = a
            crcs[f"{k}/ln_f.weight"] = crc32_of(a)
    manifest["index"]["params"]["ln_f.weight"] = [16, 2]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert "verified" in inspect(ckpt, verify=True)  # a sound checkpoint in itself
    with pytest.raises(CheckpointError, match=r"ln_f.weight \[16, 2\] \(yours \[32\]\)"):
        _fit(_cfg(dataset_path, tmp_path / "again", **{"train.resume": str(ckpt)}))


V1_MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")
V3_MODEL_KEYS = ("arch", "n_kv_head", "ffn_hidden", "rope_theta", "rope_scaling", "norm_eps",
                 "tie_embeddings")
V5_MODEL_KEYS = ("qkv_bias", "moe_experts", "moe_top_k", "moe_shared", "moe_shared_gate",
                 "moe_every", "moe_ffn_hidden", "moe_router", "moe_norm_topk")


def test_a_version_1_checkpoint_still_loads(dataset_path, tmp_path):
    """The manifest's model record is ``GPTConfig.shape()``. A field added to GPTConfig
    is a key that every older checkpoint lacks: this fails first, so that the format's
    VERSION, the versions it reads and ``upgrade_model_record`` change with it. Version
    2 added ``vocab_multiple``, version 3 the architecture's keys, version 5 the
    mixture-of-experts keys; a version 1
    checkpoint is an unpadded GPT-2 model: it resumes with --model.vocab_multiple=1, and
    today's default (64) is refused with that fix."""
    assert sorted(sharded.MODEL_KEYS) == sorted(V1_MODEL_KEYS + ("vocab_multiple",)
                                                + V3_MODEL_KEYS + V5_MODEL_KEYS)
    unpadded = {"model.vocab_multiple": 1}
    _fit(_cfg(dataset_path, tmp_path / "old", **unpadded))
    ckpt = tmp_path / "old" / "checkpoints" / "step_000010"
    mf = ckpt / "manifest.json"
    manifest = json.loads(mf.read_text())
    manifest["version"] = 1  # as version 1 wrote it
    manifest["model"] = {k: manifest["model"][k] for k in V1_MODEL_KEYS}
    mf.write_text(json.dumps(manifest))
    upgraded = read_manifest(ckpt).data["model"]
    assert upgraded["vocab_multiple"] == 1
    assert (upgraded["arch"], upgraded["ffn_hidden"], upgraded["tie_embeddings"]) == \
        ("gpt", 4 * upgraded["n_embd"], True)
    with pytest.raises(CheckpointError, match=r"vocab_multiple=1 \(yours 64\); resume with "
                                              r"--model.vocab_multiple=1$"):
        _trainer(_cfg(dataset_path, tmp_path / "padded", **{"train.resume": str(ckpt)}))
    _, resumed = _fit(_cfg(dataset_path, tmp_path / "again",
                           **unpadded, **{"train.resume": str(ckpt), "train.max_iters": 12}))
    assert len(resumed.losses) == 2  # steps 10 and 11: it went on from the checkpoint


def test_a_checkpoint_of_an_unknown_version_is_refused(runs, tmp_path):
    ckpt = _copy_checkpoint(runs, "replicated", tmp_path / "step_000010")
    mf = ckpt / "manifest.json"
    mf.write_text(json.dumps({**json.loads(mf.read_text()), "version": 6}))
    with pytest.raises(CheckpointError, match="not an hpctrain sharded checkpoint of version "
                                              "1, 2, 3, 4 or 5"):
        read_manifest(ckpt)


# ------------------------------------------------------------------ 5. crafted files

def test_latest_must_name_a_directory_beside_it(runs, dataset_path, tmp_path):
    """A ``latest`` naming ``../elsewhere`` (which holds a valid checkpoint) or an
    absolute path is refused, not followed."""
    root = tmp_path / "run" / "checkpoints"
    _copy_checkpoint(runs, "replicated", root / "step_000010")
    _copy_checkpoint(runs, "replicated", tmp_path / "run" / "elsewhere")
    for name in ("../elsewhere", str(tmp_path / "run" / "elsewhere"), ".", ""):
        (root / "latest").write_text(name + "\n")
        for path in (root, tmp_path / "run"):
            with pytest.raises(CheckpointError, match="not a checkpoint directory beside it"):
                read_manifest(path)
        with pytest.raises(CheckpointError, match="latest"):
            _fit(_cfg(dataset_path, tmp_path / "run", **{"train.resume": "auto"}))
    (root / "latest").write_text("step_000010\n")
    assert read_manifest(tmp_path / "run").step == 10


@pytest.mark.parametrize("layout,dataset", [("replicated", "param/wte.weight"),
                                            ("zero", "bucket_0/exp_avg"),
                                            ("replicated", "rng/torch")])
def test_shard_dataset_declared_other_than_the_manifest_is_not_read(runs, tmp_path,
                                                                   monkeypatch, layout,
                                                                   dataset):
    """A shard whose dataset is replaced by a bigger one (lazily allocated, as a crafted
    file would declare terabytes) is refused from its declared shape, before any read."""
    ckpt = _copy_checkpoint(runs, layout, tmp_path / "step_000010")
    with h5py.File(ckpt / shard_name(0), "r+") as f:
        shape, dtype = f[dataset].shape, f[dataset].dtype
        del f[dataset]
        f.create_dataset(dataset, shape=(shape[0] * 1000, *shape[1:]), dtype=dtype,
                         chunks=True)
    spy = ReadSpy(monkeypatch)
    with pytest.raises(CheckpointError, match=f"dataset {dataset} is declared .*manifest"):
        inspect(ckpt, verify=True) if dataset != "rng/torch" else \
            sharded.read_rng(read_manifest(ckpt), 0)
    assert f"/{dataset}" not in spy.names


def test_final_h5_declaring_more_than_the_file_holds_is_not_read(runs, tmp_path, monkeypatch):
    final = tmp_path / "final.h5"
    shutil.copy(runs / "replicated" / "final.h5", final)
    assert load_single_file(final).model["wte.weight"].shape == (128, 32)  # 95 rows, padded
    with h5py.File(final, "r+") as f:
        del f["model/wte.weight"]
        f.create_dataset("model/wte.weight", shape=(950_000, 32), dtype="f4")
    spy = ReadSpy(monkeypatch)
    with pytest.raises(UserError, match=r"wte.weight declares 121,600,000 bytes .* but the "
                                        r"file stores 0 of them"):
        load_single_file(final)
    assert "/model/wte.weight" not in spy.names


def test_token_file_checksum_table_is_checked_before_it_is_read(dataset_path, tmp_path,
                                                                monkeypatch):
    from hpctrain.data.dataset import read_info

    bad = tmp_path / "bad.h5"
    shutil.copy(dataset_path, bad)
    with h5py.File(bad, "r+") as f:
        block_bytes = f["crc32/train"].attrs["block_bytes"]
        del f["crc32/train"]
        f.create_dataset("crc32/train", shape=(1 << 20,), dtype="u4", chunks=True)
        f["crc32/train"].attrs["block_bytes"] = block_bytes
    spy = ReadSpy(monkeypatch)
    with pytest.raises(DataError, match="checksum table of train is uint32 of shape"):
        read_info(bad)
    assert "/crc32/train" not in spy.names


# -------------------------------------------------------- 6. modes follow the umask

@pytest.mark.parametrize("mask,dir_mode,file_mode", [(0o022, 0o755, 0o644),
                                                     (0o027, 0o750, 0o640)],
                         ids=["umask-022", "umask-027"])
def test_saved_files_follow_the_umask(runs, dataset_path, tmp_path, mask, dir_mode,
                                      file_mode):
    from hpctrain.checkpoint.ckpt_commands import export

    old = os.umask(mask)
    try:
        _fit(_cfg(dataset_path, tmp_path / "run"))
        export(runs / "replicated", "safetensors", tmp_path / "w.safetensors")
        export(runs / "replicated", "hf", tmp_path / "hf")
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    ckpt = tmp_path / "run" / "checkpoints" / "step_000010"
    assert mode(ckpt) == dir_mode
    assert {p.name: mode(p) for p in ckpt.iterdir()} == \
        {"manifest.json": file_mode, shard_name(0): file_mode}
    assert mode(tmp_path / "run" / "checkpoints" / "latest") == file_mode
    assert mode(tmp_path / "run" / "final.h5") == file_mode
    assert mode(tmp_path / "w.safetensors") == file_mode
    assert mode(tmp_path / "hf") == dir_mode
    assert all(mode(p) == file_mode for p in (tmp_path / "hf").iterdir())
