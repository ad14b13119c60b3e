"""The system registry (hpctrain/systems/): one file per machine, read by one loader for
job scripts, the launcher, the performance model and MFU."""

from __future__ import annotations

from pathlib import Path

import shlex

import pytest

from hpctrain.cli import main
from hpctrain.errors import EXIT_USER_ERROR, UserError
from hpctrain.systems.registry import load_system, system_names
from tests.test_layering import import_graph

REPO = Path(__file__).resolve().parents[1]
CMD = ["train", "default", "--data.path=datasets/stdlib-char.h5", "--train.batch_size=96"]


def launch_block(text: str) -> list[str]:
    """The LAUNCH=( ... ) array of a script, as the words bash would build (unexpanded)."""
    lines = text.splitlines()
    start = lines.index("LAUNCH=(")
    return [w for line in lines[start + 1:lines.index(")", start)] for w in shlex.split(line)]


def test_every_system_has_batch_and_launch_and_the_gpu_systems_perf():
    assert set(system_names()) == {"aurora", "frontier", "local", "pbs", "perlmutter",
                                   "polaris", "slurm"}
    for name in system_names():
        s = load_system(name)
        assert s.batch.scheduler in ("pbs", "slurm", "none") and s.launch.launcher
    assert {n for n in system_names() if load_system(n).perf} == {"aurora", "local", "polaris"}


def test_the_registry_imports_nothing_of_hpctrain_but_errors_and_itself():
    graph = import_graph()
    for module in [m for m in graph if m == "hpctrain.systems" or
                   m.startswith("hpctrain.systems.")]:
        # sizes: the unit constants (MiB, GiB) the [perf] figures convert with
        outside = {m for m in graph[module] if not m.startswith("hpctrain.systems.")}
        assert outside <= {"hpctrain.errors", "hpctrain.sizes"}, module


def test_the_old_registries_are_gone():
    for old in ("hpctrain/jobs/profiles", "hpctrain/scaling/systems"):
        assert not list((REPO / old).glob("*.toml")), f"{old}: system files belong in systems/"
    assert "systems/*.toml" in (REPO / "setup.cfg").read_text()


def test_an_unknown_system_is_the_same_error_for_jobscript_launch_and_plan(capsys):
    for argv in (["jobscript", "--system", "nosuch", "--walltime", "00:30:00", "--", *CMD],
                 ["launch", "--dry-run", "--system", "nosuch", "--", *CMD],
                 ["plan", "--system", "nosuch", "--nodes", "1", "--model", "gpt2"]):
        assert main(argv) == EXIT_USER_ERROR
        err = capsys.readouterr().err
        assert "unknown system 'nosuch'; built-in systems: aurora, frontier, local" in err


def test_jobscript_and_plan_read_the_same_system_file(tmp_path, monkeypatch, capsys):
    # One registry: edit polaris.toml (a copy standing in for the package's) and both
    # commands see the edit. A second reader of another file would miss it.
    import hpctrain.systems.registry as registry

    for f in (REPO / "hpctrain/systems").glob("*.toml"):
        (tmp_path / f.name).write_text(f.read_text())
    polaris = tmp_path / "polaris.toml"
    text = polaris.read_text()
    for old, new in (("ranks_per_node = 4", "ranks_per_node = 2"),
                     ("device_memory_gib = 40.0", "device_memory_gib = 80.0")):
        assert old in text
        text = text.replace(old, new)
    polaris.write_text(text)
    monkeypatch.setattr(registry, "_folder", lambda: tmp_path)
    assert registry.load_system("polaris").launch.ranks_per_node == 2
    assert main(["jobscript", "--system", "polaris", "--nodes", "1", "--walltime", "00:30:00",
                 "--queue", "debug", "--account", "P", "--venv", "none", "--", *CMD]) == 0
    out = capsys.readouterr().out
    assert "RANKS_PER_NODE=2\n" in out and launch_block(out)[3:5] == ["--ppn", "2"]
    assert main(["plan", "--system", "polaris", "--nodes", "2", "--model", "gpt2",
                 "--top", "1"]) == 0
    assert "polaris: 2 node(s) x 2 = 4 ranks, 80 GiB per device" in capsys.readouterr().out


def test_a_system_without_perf_figures_names_those_with_them(capsys):
    assert main(["plan", "--system", "frontier", "--nodes", "2", "--model", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert "frontier has no performance figures" in err
    assert "hpctrain plan and scale know aurora, local, polaris" in err


@pytest.mark.parametrize("edit, message", [
    (("ranks_per_node = 4", "ranks_per_node = 'four'"), "[launch] ranks_per_node must be an "
                                                        "integer"),
    (("ranks_per_node = 4", "rank_per_node = 4"), "lacks [launch] ranks_per_node (is "
                                                   "rank_per_node a misspelling of it?)"),
    (("flash_attention = true", "flash_attention = true\nflash = 1"), "unknown key(s) flash in "
                                                                     "[perf]; known: base_memory"),
    (('walltime = "01:00:00"', 'walltime = "1h"'), "[batch.queues.debug] walltime = '1h' is "
                                                   "not a walltime"),
    (('device = "A100"', 'device = "B200"'), "device 'B200' has no peaks"),
    (("[perf.network]", "[perf.net]"), "lacks a [perf.network"),
    (("overlap = 0.7", "overlap = 1.5"), "overlap must be between 0 and 1"),
    (("write_gbytes_per_s = 650.0", "write_gbytes_per_s = 0.0"), "[perf.filesystem] "
                                                                 "write_gbytes_per_s"),
    (('name = "Eagle (Lustre)"', 'name = 650'), "[perf.filesystem] name must be"),
    (('scheduler = "pbs"', 'scheduler = "lsf"'), "scheduler = 'lsf': use one of pbs"),
])
def test_a_broken_system_file_names_the_table_and_key(tmp_path, edit, message):
    path = tmp_path / "mine.toml"
    text = (REPO / "hpctrain/systems/polaris.toml").read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(UserError) as e:
        load_system(str(path))
    assert message in str(e.value) and str(path) in str(e.value)


def test_the_mfu_peak_table_is_the_registry_s():
    from hpctrain.scaling.system_perf import load_perf
    from hpctrain.train.metrics import PEAK_TFLOPS

    assert PEAK_TFLOPS["A100"] == {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}
    assert load_perf("polaris").peak_flops["bf16"] == PEAK_TFLOPS["A100"]["bf16"] * 1e12


@pytest.mark.parametrize("runtime_name, dtype, peak", [
    ("NVIDIA A100-SXM4-40GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-40GB", "tf32", 156.0),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
    ("NVIDIA H100 PCIe", "bf16", 756.0),  # the more specific table comes first
    ("NVIDIA H200", "bf16", 989.0),
    ("Intel(R) Data Center GPU Max 1550", "bf16", 419.0),  # one tile (FLAT mode)
    ("AMD Instinct MI250X", "bf16", 191.5),  # one GCD
    ("AMD Instinct MI250X", "tf32", None),  # CDNA2 has no TF32
    ("cpu", "bf16", None),
    ("fake accelerator (CPU)", "fp32", None),
])
def test_the_runtime_s_device_name_finds_its_peak(runtime_name, dtype, peak):
    from hpctrain.systems.devices import peak_for_device
    from hpctrain.train.metrics import peak_tflops

    assert peak_for_device(runtime_name, dtype) == peak
    assert peak_tflops(runtime_name, dtype, override=7.0) == 7.0


def test_a_missing_or_binary_system_file_is_one_error(tmp_path):
    with pytest.raises(UserError, match="does not exist; give a built-in system"):
        load_system(str(tmp_path / "nowhere.toml"))
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe[batch]")
    with pytest.raises(UserError, match="is not UTF-8 text"):
        load_system(str(path))
    path.write_text("[batch\n")
    with pytest.raises(UserError, match="binary.toml is not valid TOML"):
        load_system(str(path))


@pytest.mark.parametrize("system", ["polaris", "aurora", "frontier", "perlmutter"])
def test_every_site_queue_cites_its_source(system):
    # Each [batch.queues.NAME] follows a comment naming the queue, and the file names the
    # guide's address and the copy read (a commit), or says why a limit is unverified.
    lines = (REPO / "hpctrain" / "systems" / f"{system}.toml").read_text().splitlines()
    text = "\n".join(lines)
    assert "https://docs." in text and ("commit" in text or "unverified:" in text), system
    for i, line in enumerate(lines):
        if line.startswith("[batch.queues."):
            name = line[len("[batch.queues."):-1]
            comment = []
            for above in reversed(lines[:i]):
                if not above.startswith("#"):
                    break
                comment.append(above)
            assert any(name in c for c in comment), f"{system} {name}: cite its source"
