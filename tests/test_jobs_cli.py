"""`hpctrain jobscript` and `launch` on the command line: printing and atomic writes,
the options' old names, jobscripts/ in sync with the generator, no torch or MPI imported."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from hpctrain.cli import main
from hpctrain.errors import EXIT_USER_ERROR
from hpctrain.jobs.render import write_script
from tests.jobs_common import CMD, REPO, bash_n


# --------------------------------------------------------------------------- the CLI

def test_cli_prints_or_writes_atomically_and_writes_nothing_on_bad_input(tmp_path, capsys):
    base = ["jobscript", "--system", "polaris", "--nodes", "2", "--walltime", "00:30:00",
            "--queue", "debug", "--account", "P", "--venv", "none"]
    assert main(base + ["--", *CMD]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("#!/bin/bash -l\n#PBS -N hpctrain\n")
    out = tmp_path / "job.sh"
    assert main(base + ["--output", str(out), "--", *CMD]) == 0
    msg = capsys.readouterr().out
    assert f"qsub {out}" in msg and "runs/hpctrain/metrics.jsonl" in msg
    assert out.read_text() == printed and out.stat().st_mode & 0o777 == 0o755
    bad = tmp_path / "bad.sh"
    assert main([*base[:4], "4", *base[5:], "--output", str(bad), "--", *CMD]) == \
        EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: queue debug on polaris takes at most 2 node(s)")
    assert not bad.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["job.sh"]
    assert main(base + ["--output", str(tmp_path / "no/dir/x.sh"), "--", *CMD]) == \
        EXIT_USER_ERROR


def test_write_script_replaces_in_one_step(tmp_path):
    path = tmp_path / "s.sh"
    path.write_text("old")
    write_script(path, "#!/bin/bash\n")
    assert path.read_text() == "#!/bin/bash\n" and list(tmp_path.iterdir()) == [path]


# ------------------------------------------------------------------ jobscripts/ in sync

def _recorded_commands() -> list[list[str]]:
    text = (REPO / "jobscripts" / "generate.sh").read_text().replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in text.splitlines()
            if line.startswith("hpctrain jobscript ")]


def test_the_profiler_option_and_its_old_name(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where CMD's --data.path exists: no warning about it
    (tmp_path / "datasets").mkdir()
    (tmp_path / "datasets" / "stdlib-char.h5").write_bytes(b"")
    base = ["jobscript", "--system", "polaris", "--nodes", "1", "--walltime", "00:30:00",
            "--queue", "debug", "--account", "P", "--venv", "none"]
    assert main(base + ["--profiler", "nsys", "--", *CMD]) == 0
    new = capsys.readouterr()
    assert "--nsys-dir" in new.out and "--profiler nsys" in new.out and not new.err
    assert main(base + ["--profile", "nsys", "--", *CMD]) == 0
    old = capsys.readouterr()
    assert old.out == new.out
    assert old.err == ("warning: --profile is deprecated (removed in the next release): "
                       "--profile -> --profiler\n")


def test_jobscripts_examples_are_what_the_generator_makes(tmp_path, capsys, monkeypatch):
    commands = _recorded_commands()
    names = {Path(c[c.index("--output") + 1]).name for c in commands}
    assert names == {p.name for p in (REPO / "jobscripts").glob("*.sh")} - {"generate.sh"}
    assert len(names) == 5
    monkeypatch.chdir(REPO)
    for argv in commands:
        target = REPO / argv[argv.index("--output") + 1]
        fresh = tmp_path / target.name
        argv[argv.index("--output") + 1] = str(fresh)
        assert main(argv) == 0, capsys.readouterr().err
        assert fresh.read_bytes() == target.read_bytes(), (
            f"jobscripts/{target.name} is out of date with the generator; regenerate the "
            "examples with `bash jobscripts/generate.sh` and review the diff")
        assert bash_n(target.read_text()).returncode == 0


def test_job_commands_import_neither_torch_nor_mpi4py():
    """They run on login nodes, where importing torch is slow and MPI must not start."""
    code = ("import sys, io, contextlib\n"
            "from hpctrain.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['jobscript', '--system', 'polaris', '--nodes', '2', '--walltime',\n"
            "                 '00:30:00', '--queue', 'debug', '--account', 'P', '--', 'train',\n"
            "                 'default']) == 0\n"
            "    assert main(['launch', '--dry-run', '--ranks', '2', '--', 'train',\n"
            "                 'default']) == 0\n"
            "print(sorted(m for m in ('torch', 'mpi4py', 'numpy', 'h5py') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_a_command_without_the_separator_is_explained(capsys):
    assert main(["launch", "--dry-run", "train", "default"]) == EXIT_USER_ERROR
    assert "the command to run goes after '--'" in capsys.readouterr().err
