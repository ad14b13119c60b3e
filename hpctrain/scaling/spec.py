"""A scaling study: a TOML sweep spec, checked in full and expanded into points.

A spec names the study (weak or strong scaling, rank or node counts, steps, repeats,
recipe, system, calibration), the ``[batch]``, one or more ``[[models]]`` (presets or
shapes) and one or more ``[[parallel]]`` entries whose list values expand as a product.
Points are models x parallel configurations x rank counts, in that order. A combination
the trainer cannot run (pp not dividing the ranks, a batch that does not split) is left
out with the reason, never run.
Every key, with an annotated example: docs/design/scaling-model.md ("A study").
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.config import load_config, parse_overrides
from hpctrain.data.dataset import read_info
from hpctrain.errors import ConfigError, DataError, UserError
from hpctrain.model.shape import LATER_KEYS
from hpctrain.scaling.models import ModelShape, preset_shape, presets
from hpctrain.scaling.perfmodel import SCHEDULES, Arrangement
from hpctrain.scaling.system_perf import SystemPerf, load_perf
from hpctrain.systems.registry import load_system

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STUDY_KEYS = {"name", "scaling", "ranks", "nodes", "steps", "repeats", "recipe", "system",
              "calibration", "timeout_s", "overrides", "dtype", "description"}
PARALLEL_KEYS = {"name", "zero", "pp", "micro_batches", "schedule", "virtual_stages", "tp",
                 "sequence_parallel"}
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
OPTIONAL_SHAPE_KEYS = ("bias", *LATER_KEYS)
"""``ModelShape``'s fields with a default (GPT-2's): a [[models]] table may set them."""


@dataclass(frozen=True)
class Point:
    id: str
    model: ModelShape
    arrangement: Arrangement
    parallel: str
    """The name of the [[parallel]] entry (one line per name in plots)."""
    nodes: int

    def series(self) -> str:
        """Points that differ only in their rank count form one scaling series."""
        return f"{self.model.label} / {self.parallel}"


@dataclass(frozen=True)
class Study:
    name: str
    path: Path
    scaling: str
    ranks: tuple
    nodes: tuple | None
    steps: int
    repeats: int
    recipe: str
    system: str
    calibration: Path | None
    timeout_s: float
    overrides: tuple
    dtype: str
    batch_per_rank: int | None
    global_batch: int | None
    points: tuple
    skipped: tuple = field(default=())
    """``(description, reason)`` of combinations left out."""
    description: str = ""


def _err(path, msg: str) -> UserError:
    return UserError(f"study {path}: {msg}")


def _int_list(path, where: str, value, minimum: int = 1) -> list[int]:
    items = value if isinstance(value, list) else [value]
    if not items or any(not isinstance(i, int) or isinstance(i, bool) or i < minimum
                        for i in items):
        raise _err(path, f"{where} must be an integer >= {minimum} or a list of them, "
                         f"not {value!r}")
    return items


def read_spec(path: Path) -> dict:
    """The study file's tables; a missing, unreadable or broken file is one UserError."""
    if not path.is_file():
        raise UserError(f"study spec {path} does not exist; see perf/studies/local.toml")
    try:
        text = path.read_text()
    except OSError as e:
        raise _err(path, f"cannot be read ({e.strerror}); check its permissions") from None
    except UnicodeDecodeError:
        raise _err(path, "is not UTF-8 text; a study spec is a TOML file (see "
                         "perf/studies/local.toml)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _err(path, f"not valid TOML ({e}); fix the line it names") from None


def load_study(path: str | os.PathLike, *, ranks_per_node: int | None = None,
               vocab_size: int | None = None) -> Study:
    """Read and check a study spec, the one reader of study files.

    ``nodes = [...]`` takes the ranks per node of the study's system (``[launch]`` of
    ``hpctrain/systems/<system>.toml``) unless ``ranks_per_node`` is given; a model
    without ``vocab_size`` takes the vocabulary of the data file the study trains on
    unless ``vocab_size`` is given."""
    path = Path(path)
    spec = read_spec(path)
    settings, ranks_per_node = _study_settings(path, _study_table(path, spec), ranks_per_node)
    per_rank, global_batch = _batch(path, spec, settings["scaling"])
    study = Study(path=path, **settings, batch_per_rank=per_rank, global_batch=global_batch,
                  points=())
    models = _models(path, spec, study, vocab_size)
    parallels = [_parallel(path, p) for p in _tables(path, spec, "parallel")]
    points, skipped = _points(study, models, parallels, ranks_per_node)
    return dataclasses.replace(study, points=points, skipped=skipped)


def _study_table(path, spec: dict) -> dict:
    """The [study] table, once the spec holds no unknown key or table."""
    s = spec.get("study")
    if not isinstance(s, dict):
        raise _err(path, "needs a [study] table with name, scaling, ranks, steps")
    unknown = set(s) - STUDY_KEYS
    if unknown:
        raise _err(path, f"unknown key(s) in [study]: {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(STUDY_KEYS))}")
    unknown_tables = set(spec) - {"study", "batch", "models", "parallel"}
    if unknown_tables:
        raise _err(path, f"unknown table(s) {', '.join(sorted(unknown_tables))}; use "
                         "[study], [batch], [[models]], [[parallel]]")
    return s


def _study_settings(path, s: dict, ranks_per_node: int | None) -> tuple[dict, int | None]:
    """The [study] table's values, checked in turn, as ``Study`` fields; and the ranks per
    node that ``nodes = [...]`` was multiplied by."""
    scaling = s.get("scaling")
    if scaling not in ("weak", "strong"):
        raise _err(path, f"scaling = {scaling!r}: use \"weak\" (fixed batch per data-parallel "
                         "rank) or \"strong\" (fixed global batch)")
    if ("ranks" in s) == ("nodes" in s):
        raise _err(path, "give exactly one of ranks = [...] or nodes = [...]")
    system = s.get("system", "local")
    if not isinstance(system, str) or not system:
        raise _err(path, f"system = {system!r}: name a system (polaris, aurora, local) or "
                         "the path of a .toml file")
    recipe = s.get("recipe", "default")
    if not isinstance(recipe, str):
        raise _err(path, f"recipe = {recipe!r}: name a recipe, e.g. recipe = \"default\"")
    ranks, nodes, ranks_per_node = _rank_counts(path, s, system, ranks_per_node)
    steps = _int_list(path, "steps", s.get("steps", 30), minimum=3)[0]
    repeats = _int_list(path, "repeats", s.get("repeats", 1))[0]
    timeout = s.get("timeout_s", 600)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise _err(path, f"timeout_s must be a positive number of seconds, not {timeout!r}")
    overrides = s.get("overrides", [])
    if not isinstance(overrides, list) or any(not isinstance(o, str) or not o.startswith("--")
                                              for o in overrides):
        raise _err(path, "overrides must be a list of '--section.key=value' strings")
    dtype = s.get("dtype", "fp32")
    if dtype not in ("fp32", "bf16"):
        raise _err(path, f"dtype {dtype!r}: use fp32 or bf16")
    calibration = s.get("calibration")
    return dict(name=s.get("name") or path.stem, scaling=scaling, ranks=ranks, nodes=nodes,
                steps=steps, repeats=repeats, recipe=recipe, system=system,
                calibration=(path.parent / calibration) if calibration else None,
                timeout_s=float(timeout), overrides=tuple(overrides), dtype=dtype,
                description=s.get("description", "")), ranks_per_node


def _rank_counts(path, s: dict, system: str,
                 ranks_per_node: int | None) -> tuple[tuple, tuple | None, int | None]:
    """(ranks, nodes, ranks per node): ``ranks = [...]`` as given, or ``nodes = [...]``
    times the system's ranks per node (unless the caller gave them)."""
    if "nodes" not in s:
        return tuple(_int_list(path, "ranks", s["ranks"])), None, ranks_per_node
    nodes = tuple(_int_list(path, "nodes", s["nodes"]))
    if ranks_per_node is None:
        ranks_per_node = _system_ranks_per_node(path, system)
    if not ranks_per_node:
        raise _err(path, "nodes = [...] needs a system with ranks per node (polaris, "
                         "aurora); on this machine use ranks = [...]")
    return tuple(n * ranks_per_node for n in nodes), nodes, ranks_per_node


def _batch(path, spec: dict, scaling: str) -> tuple[int | None, int | None]:
    """(sequences per data-parallel rank, global batch) from [batch]: weak scaling fixes
    the first, strong scaling the second; the other is None."""
    batch = spec.get("batch", {})
    per_rank, global_batch = batch.get("per_rank"), batch.get("global")
    if scaling == "weak" and (per_rank is None or global_batch is not None):
        raise _err(path, "weak scaling fixes the batch per data-parallel rank: give "
                         "[batch] per_rank = N (and no global)")
    if scaling == "strong" and (global_batch is None or per_rank is not None):
        raise _err(path, "strong scaling fixes the global batch: give [batch] global = N "
                         "(and no per_rank)")
    _int_list(path, "[batch]", per_rank if scaling == "weak" else global_batch)
    return per_rank, global_batch


def _models(path, spec: dict, study: Study, vocab_size: int | None) -> list[ModelShape]:
    """The [[models]] shapes; those without a vocabulary take the data file's."""
    model_tables = _tables(path, spec, "models")
    if vocab_size is None and any("vocab_size" not in m and "preset" not in m
                                  for m in model_tables):
        vocab_size = data_vocab(path, study.recipe, study.overrides)
    return [_model(path, m, vocab_size) for m in model_tables]


def _points(study: Study, models: list[ModelShape], parallels: list,
            ranks_per_node: int | None) -> tuple[tuple, tuple]:
    """(points, skipped): models x parallel configurations x rank counts, in that order;
    a combination the trainer cannot run is skipped with the reason."""
    path, points, skipped = study.path, [], []
    for model, (pname, combos) in itertools.product(models, parallels):
        seen = set()
        for (zero, pp, micro, sched, v, tp, sp), n in itertools.product(combos, study.ranks):
            if pp == 1:  # schedules only differ with stages: one point, not one per schedule
                sched, v = "1f1b", 1
                if (zero, micro, tp, sp, n) in seen:
                    continue
                seen.add((zero, micro, tp, sp, n))
            label = (f"{model.label} {pname} zero={zero} pp={pp} m={micro}"
                     + (f" tp={tp}" if tp > 1 else "") + f" ranks={n}")
            if n % (pp * tp):
                split = f"pp={pp}" + (f" x tp={tp}" if tp > 1 else "")
                skipped.append((label, f"{split} does not divide {n} rank(s)"))
                continue
            dp = n // (pp * tp)
            g = study.batch_per_rank * dp if study.scaling == "weak" else study.global_batch
            arrangement = Arrangement(ranks=n, pp=pp, zero=zero, micro_batches=micro,
                                      global_batch=g, dtype=study.dtype, schedule=sched,
                                      virtual_stages=v, tp=tp, sequence_parallel=sp)
            try:
                arrangement.check(model)
            except UserError as e:
                skipped.append((label, str(e)))
                continue
            pipe = "" if pp == 1 else f"-{sched}" + (f"{v}" if sched == "interleaved" else "")
            tensor = f"-tp{tp}" + ("sp" if sp else "") if tp > 1 else ""
            pid = (f"{_slug(model.label)}-{_slug(pname)}-z{zero}-pp{pp}{pipe}{tensor}-m{micro}"
                   f"-n{n}")
            points.append(Point(pid, model, arrangement, pname,
                                n // ranks_per_node if study.nodes else 1))
    if not points:
        raise _err(path, "no point can run: " + "; ".join(f"{a}: {b}" for a, b in skipped[:3]))
    ids = [p.id for p in points]
    if len(set(ids)) != len(ids):
        raise _err(path, "two points have the same id; give each [[models]] and [[parallel]] "
                         "entry its own name")
    return tuple(points), tuple(skipped)


def study_system(study: Study) -> SystemPerf:
    """The study's system for the performance model, with the study's calibration."""
    calib = study.calibration
    if calib and not calib.is_file():
        raise UserError(f"{study.path} names calibration {calib}, which does not exist; make "
                        f"it with `hpctrain scale calibrate {study.path} --output {calib}` or "
                        "drop the line")
    return load_perf(study.system, calib)


def _system_ranks_per_node(path, system: str) -> int:
    try:
        return load_system(system).launch.ranks_per_node
    except UserError as e:
        raise _err(path, f"system = {system!r}: {e}") from None


def data_vocab(path, recipe: str, overrides: list[str]) -> int | None:
    """The vocabulary of the data file the study trains on; None when that file cannot be
    read here (e.g. on a login node before the data is staged)."""
    try:
        cfg = load_config(recipe, parse_overrides(list(overrides)))
    except ConfigError as e:
        raise _err(path, f"recipe and overrides: {e}") from None
    try:
        return read_info(cfg.data.path).vocab_size
    except DataError:
        return None


def _tables(path, d: dict, key: str) -> list[dict]:
    items = d.get(key)
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise _err(path, f"needs at least one [[{key}]] table")
    return items


def _model(path, m: dict, vocab_size: int | None) -> ModelShape:
    unknown = set(m) - set(SHAPE_KEYS) - set(OPTIONAL_SHAPE_KEYS) - {"name", "preset"}
    if unknown:
        raise _err(path, f"unknown key(s) in [[models]]: {', '.join(sorted(unknown))}")
    shape = {k: m[k] for k in SHAPE_KEYS + OPTIONAL_SHAPE_KEYS if k in m}
    if "preset" in m:
        return preset_shape(m["preset"], **shape)
    shape.setdefault("vocab_size", vocab_size)
    missing = [k for k in SHAPE_KEYS if not shape.get(k)]
    if missing:
        hint = " (or make the data file readable: the vocabulary comes from it)" \
            if missing == ["vocab_size"] else f" (or preset = one of {', '.join(presets())})"
        raise _err(path, f"model {m.get('name', '?')!r} lacks {', '.join(missing)}{hint}")
    return ModelShape(name=str(m.get("name", "")), **shape)


def _parallel(path, p: dict) -> tuple[str, list]:
    unknown = set(p) - PARALLEL_KEYS
    if unknown:
        raise _err(path, f"unknown key(s) in [[parallel]]: {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(PARALLEL_KEYS))}")
    zero = _int_list(path, "zero", p.get("zero", 0), minimum=0)
    if any(z > 3 for z in zero):
        raise _err(path, f"zero = {zero}: stages are 0, 1, 2, 3")
    pp = _int_list(path, "pp", p.get("pp", 1))
    micro = _int_list(path, "micro_batches", p.get("micro_batches", 1))
    sched = p.get("schedule", "1f1b")
    scheds = sched if isinstance(sched, list) else [sched]
    if any(x not in SCHEDULES for x in scheds):
        raise _err(path, f"schedule {sched!r}: use {', '.join(SCHEDULES)}")
    v = _int_list(path, "virtual_stages", p.get("virtual_stages", 1))
    tp = _int_list(path, "tp", p.get("tp", 1))
    sp = p.get("sequence_parallel", False)
    sps = sp if isinstance(sp, list) else [sp]
    if not sps or any(not isinstance(x, bool) for x in sps):
        raise _err(path, f"sequence_parallel = {sp!r}: use true or false")
    name = str(p.get("name") or f"zero{zero[0]}")
    return name, list(itertools.product(zero, pp, micro, scheds, v, tp, sps))


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in text)
