"""``hpctrain ckpt export --format dcp`` and ``ckpt import --from dcp``: torch Distributed
Checkpoint (``torch.distributed.checkpoint``) directories, the format torchtitan saves.

The export is one ``dcp.save`` on this process, without a process group: the model's
tensors at the top level (as torchtitan flattens its model state, names from
``dcp_names.py``), the Adam state under ``optimizer`` in the keys of torch's
``get_optimizer_state_dict`` (``state.<name>.exp_avg``, ``.exp_avg_sq``, ``.step``)
when the checkpoint has any, and ``hpctrain_dcp.json`` beside them with the model and
tokenizer records. The import reads the tensors a DCP directory of any world size holds
(``dcp.load`` assembles the shards), maps them back and writes ``weights.save_weights``'s
checkpoint, as ``ckpt import --from hf`` does. ``docs/design/dcp-interop.md``.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path

import torch

from hpctrain.atomic import temporary_directory
from hpctrain.checkpoint.dcp_names import dcp_names, from_dcp, to_dcp
from hpctrain.checkpoint.hf_config import from_hf_config
from hpctrain.checkpoint.hf_import import Imported, read_json_object
from hpctrain.checkpoint.sharded import CheckpointError, read_full_state, read_manifest
from hpctrain.checkpoint.weights import save_weights
from hpctrain.model.shape import GPTConfig
from hpctrain.output_paths import check_output_folder
from hpctrain.sizes import MAX_WIDTH, whole

SIDECAR = "hpctrain_dcp.json"
METADATA = ".metadata"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def export_dcp(path: str | Path, output: str | Path) -> Path:
    """The checkpoint ``path`` as a new DCP directory ``output``, whole or not at all."""
    out = check_output_folder(output, inputs=[path], error=CheckpointError)
    m = read_manifest(path)
    model = m.data["model"]
    full = read_full_state(m)
    state: dict = to_dcp({n: s["param"] for n, s in full.items()}, model)
    step = float(m.data["optimizer_step"])
    if step > 0:  # a checkpoint made from weights alone has no optimizer state to carry
        optim = {}
        for k in MOMENTS:
            for name, t in to_dcp({n: s[k] for n, s in full.items()}, model).items():
                optim[f"state.{name}.{k}"] = t
        for name in dcp_names(model):
            optim[f"state.{name}.step"] = torch.tensor(step)
        state["optimizer"] = optim
    sidecar = {"format": "hpctrain-dcp", "step": m.step, "optimizer_step": step,
               "model": model, "tokenizer": m.data.get("tokenizer")}
    with temporary_directory(out) as tmp:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with warnings.catch_warnings():  # "assuming ... a single process": as meant
                warnings.filterwarnings("ignore", message=".*single process")
                _dcp().save(state, checkpoint_id=tmp, no_dist=True)
        except CheckpointException as e:  # its own error (a full disk): hpctrain.atomic's
            raise _first_error(e) from None
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=1), encoding="utf-8")
    return out


def import_dcp(source: str | Path, output: str | Path, *, config: str | Path | None = None,
               vocab_multiple: int | None = None) -> Imported:
    """A DCP directory's model tensors as a new weights-only checkpoint ``output``. The
    model record is ``hpctrain_dcp.json``'s (an hpctrain export) or ``config``'s (that same
    file of another export, or a Hugging Face ``config.json`` of the model).
    ``vocab_multiple``: pad the vocabulary to it (default: the record's, 1 for a Hugging
    Face config)."""
    src = Path(source)
    if not (src / METADATA).is_file():
        raise CheckpointError(f"{src} is not a torch Distributed Checkpoint directory (no "
                              f"{METADATA}); pass the directory dcp.save wrote, such as "
                              "torchtitan's checkpoint/step-N")
    out = check_output_folder(output, inputs=[src] + ([config] if config else []),
                              error=CheckpointError)
    if vocab_multiple is not None:
        whole(vocab_multiple, "--vocab-multiple", 1, MAX_WIDTH, error=CheckpointError,
              fix="pad to a small multiple such as 64, or 1 for none")
    metadata = _read_metadata(src)
    shapes = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    model, tokenizer, notes = _model_record(src, config, shapes, vocab_multiple)
    names = _find_names(src, shapes, model)
    head = _tied_head(names, shapes, model)
    want = {f"{prefix}{n}": torch.empty(tuple(shapes[f"{prefix}{n}"].size),
                                        dtype=shapes[f"{prefix}{n}"].properties.dtype)
            for prefix, n in names + head}
    bad = [k for k, t in want.items() if not t.is_floating_point()]
    if bad:
        raise CheckpointError(f"{src}: {bad[0]} is {want[bad[0]].dtype}, not floating point; "
                              "hpctrain imports unquantized weights")
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        with warnings.catch_warnings():  # "assuming ... a single process": as meant
            warnings.filterwarnings("ignore", message=".*single process")
            _dcp().load(want, storage_reader=_SafeReader(src), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch's own types
        raise CheckpointError(f"{src}: its tensors do not read ({_reason(e)}); copy the "
                              "directory again (a missing or truncated .distcp file?)") from None
    tensors = {n: want[f"{prefix}{n}"] for prefix, n in names + head}
    for _, n in head:  # a tied model's head, saved too: it must be the embedding
        emb = tensors[names[0][1]]
        if tensors[n].shape != emb.shape or not torch.equal(tensors[n], emb):
            raise CheckpointError(f"{src}: {n} differs from {names[0][1]}, but the model "
                                  "record ties the head to the embedding; give a record "
                                  "with an untied head (tie_word_embeddings false)")
    try:
        params = from_dcp(tensors, model)
    except ValueError as e:
        raise CheckpointError(f"{src}: {e}; the checkpoint and the model record are of "
                              "different models") from None
    del tensors, want
    note = {"from": "dcp", "path": str(src.resolve())}
    path = save_weights(out, params, model, tokenizer=tokenizer, note=note)
    return Imported(path, model, sum(t.numel() for t in params.values()), notes)


def _first_error(e: BaseException) -> BaseException:
    """The first rank's own error inside torch's ``CheckpointException`` (whose text is
    a traceback), else ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (the error, its stack) in torch 2.13
        first = first[0] if isinstance(first, tuple) and first else first
        if isinstance(first, Exception):
            return first
    return e


def _reason(e: BaseException) -> str:
    """One line for an error of ``dcp.load``."""
    e = _first_error(e)
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:200] if text else type(e).__name__


class _SafeUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle. Unpickling runs code a file names, so only the
    classes DCP's metadata is built of are let through."""

    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name)
        ok = (module.startswith("torch.distributed.checkpoint.")
              or (module, name) in (("collections", "OrderedDict"), ("torch", "Size"),
                                    ("torch.serialization", "_get_layout"),
                                    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                                    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"))
              or (module == "torch" and isinstance(obj, (torch.dtype, torch.layout,
                                                         torch.memory_format))))
        if not ok:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")
        return obj


def _safe_metadata(path: Path):
    with open(path, "rb") as f:
        return _SafeUnpickler(f).load()


class _SafeReader:
    """``FileSystemReader`` whose metadata goes through ``_SafeUnpickler``."""

    def __new__(cls, path: Path):
        reader = _dcp().FileSystemReader(path)
        original = reader.read_metadata

        def read_metadata(*args, **kwargs):
            if kwargs.get("rank") is not None:  # a per-rank metadata file: torch's own
                return original(*args, **kwargs)
            md = _safe_metadata(path / METADATA)
            if getattr(md, "storage_meta", None) is not None:
                md.storage_meta.load_id = reader.load_id
            return md

        reader.read_metadata = read_metadata
        return reader


def _read_metadata(src: Path):
    try:
        md = _safe_metadata(src / METADATA)
        md.state_dict_metadata.items()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{src / METADATA}: {e}; hpctrain reads only the metadata "
                              "torch.distributed.checkpoint writes") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
        raise CheckpointError(f"{src / METADATA} is not readable DCP metadata "
                              f"({str(e)[:200]}); copy the directory again") from None
    return md


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file; pass an hpctrain_dcp.json or a Hugging "
                              "Face config.json")
    return read_json_object(path, "pass an hpctrain_dcp.json or a Hugging Face config.json")


def _model_record(src: Path, config, shapes: dict, vocab_multiple: int):
    path = Path(config) if config else src / SIDECAR
    if not config and not path.is_file():
        raise CheckpointError(f"{src} has no {SIDECAR} (it was not written by hpctrain): "
                              "name the model with --config FILE, the Hugging Face "
                              "config.json of the same model or an hpctrain export's "
                              f"{SIDECAR}")
    d = _read_json(path)
    tokenizer = d.get("tokenizer") if isinstance(d.get("tokenizer"), dict) else None
    try:
        if "model_type" in d:
            bias = any(k.endswith(".bias") for k in shapes)
            model, notes = from_hf_config(d, bias=bias, vocab_multiple=(
                1 if vocab_multiple is None else vocab_multiple))
        elif isinstance(d.get("model"), dict):
            model = dict(d["model"])
            if vocab_multiple is not None:
                model["vocab_multiple"] = vocab_multiple
            model, notes = GPTConfig.from_shape(model).shape(), []
        else:
            raise ValueError("it holds neither model_type (a Hugging Face config.json) nor "
                             "a model record (hpctrain_dcp.json)")
    except KeyError as e:
        raise CheckpointError(f"{path}: its model record lacks {e}; pass an hpctrain export's "
                              f"{SIDECAR} or the model's Hugging Face config.json") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    if tokenizer is None:
        notes.append(f"{path} records no tokenizer: prepare data with a tokenizer whose ids "
                     "are the model's")
    return model, tokenizer, notes


def _tied_head(names: list[tuple[str, str]], shapes: dict, model: dict
               ) -> list[tuple[str, str]]:
    """``[(prefix, head)]`` when the model ties its head and the checkpoint holds one
    anyway (an FSDP state dict of a tied model has both), else ``[]``."""
    prefix, first = names[0]
    head = "output.weight" if first == "tok_embeddings.weight" else "lm_head.weight"
    return ([(prefix, head)] if model["tie_embeddings"] and f"{prefix}{head}" in shapes
            else [])


LAYER = re.compile(r"(?:layers|h)\.(\d+)\.")


def _find_names(src: Path, shapes: dict, model: dict) -> list[tuple[str, str]]:
    """``(prefix, name)`` of each model tensor: at the top level (torchtitan's and
    hpctrain's export), or under ``model.`` (a state dict saved as ``{"model": ...}``)."""
    names = dcp_names(model)
    for prefix in ("", "model."):
        if all(f"{prefix}{n}" in shapes for n in names):
            break
    else:
        missing = [n for n in names if n not in shapes]
        raise CheckpointError(f"{src} lacks {', '.join(missing[:3])}"
                              f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}"
                              f" of the {model['arch']} model its record describes "
                              f"(it holds {', '.join(sorted(shapes)[:3])}, ...); the "
                              "checkpoint and the model record are of different models")
    deeper = sorted(k for k in shapes if k.startswith(prefix) and (m := LAYER.match(
        k[len(prefix):])) and int(m.group(1)) >= model["n_layer"])
    if deeper:
        raise CheckpointError(f"{src} holds {deeper[0]}, past the {model['n_layer']} layers "
                              "of the model record; the checkpoint and the record are of "
                              "different models")
    return [(prefix, n) for n in names]
