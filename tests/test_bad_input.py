"""Bad input a user can give, caught before any work starts, each with one message that
names the option and the fix: out-of-range and non-finite config values, output paths
that cannot be written, a dataset that would be replaced; the modes of published files;
a stalled rank in `prepare` (real mpiexec in a subprocess, under time limits). The MPI
cases in process live in tests/test_prepare_mpi.py."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import stat
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from hpctrain.config import SECTION_TYPES, Config, build_config, check_out_dir
from hpctrain.errors import ConfigError, DataError
from tests.helpers import REPO, hpctrain_cmd, run

# ------------------------------------------------------------------ config values


def _number_fields():
    """(section.key, type, metadata) of every int and float field of every section."""
    for section, cls in SECTION_TYPES.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                yield f"{section}.{f.name}", hints[f.name], f.metadata


NUMBER_FIELDS = list(_number_fields())
FLOAT_FIELDS = [key for key, typ, _ in NUMBER_FIELDS if typ is float]


def _build(key: str, value) -> Config:
    section, name = key.split(".")
    return build_config({section: {name: value}})


def test_every_number_field_declares_its_valid_range():
    # A new int or float option without bounds (or choices) would accept anything.
    missing = [key for key, _, meta in NUMBER_FIELDS
               if meta.get("bounds") is None and not meta.get("choices")]
    assert not missing, f"give these fields bounds=... in config/sections.py: {missing}"


@pytest.mark.parametrize("key", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused_naming_the_option_and_range(key, value):
    with pytest.raises(ConfigError, match=rf"^{key} must be a finite number .*, not {value}$"):
        _build(key, value)


@pytest.mark.parametrize("key,typ,meta", [f for f in NUMBER_FIELDS if f[2].get("bounds")],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_values_just_outside_each_range_are_refused(key, typ, meta):
    bounds = meta["bounds"]
    below = bounds.low if bounds.low_open else bounds.low - (1 if typ is int else 1e-9)
    with pytest.raises(ConfigError, match=rf"^{key} must be "):
        _build(key, typ(below))
    if bounds.high is not None:
        above = bounds.high if bounds.high_open else bounds.high + 1
        with pytest.raises(ConfigError, match=rf"^{key} must be "):
            _build(key, typ(above))


def test_the_defaults_are_inside_their_ranges():
    Config()  # every section's defaults pass their own checks


BAD_OPTIONS = [
    ("--optim.eps=-1", "optim.eps must be a finite number > 0, not -1.0"),
    ("--optim.eps=0", "optim.eps must be a finite number > 0, not 0.0"),
    ("--model.n_embd=0", "model.n_embd must be at least 1, not 0"),
    ("--model.n_embd=-128", "model.n_embd must be at least 1, not -128"),
    ("--model.n_layer=0", "model.n_layer must be at least 1, not 0"),
    ("--model.n_head=0", "model.n_head must be at least 1, not 0"),
    ("--model.block_size=0", "model.block_size must be at least 1, not 0"),
    ("--optim.lr=inf", "optim.lr must be a finite number > 0, not inf"),
    ("--optim.lr=nan", "optim.lr must be a finite number > 0, not nan"),
    ("--optim.weight_decay=nan", "optim.weight_decay must be a finite number >= 0, not nan"),
    ("--optim.grad_clip=inf", "optim.grad_clip must be a finite number >= 0, not inf"),
    ("--comm.timeout=inf", "comm.timeout must be a finite number in (0, 604800], not inf"),
    ("--comm.timeout=nan", "comm.timeout must be a finite number in (0, 604800], not nan"),
    ("--comm.timeout=1e10", "comm.timeout must be a finite number in (0, 604800], not 10000000000.0"),
    ("--parallel.bucket_mb=nan", "parallel.bucket_mb must be a finite number > 0, not nan"),
    ("--train.peak_tflops=inf", "train.peak_tflops must be a finite number >= 0, not inf"),
    ("--train.seed=-1", "train.seed must be in [0, 18446744073709551615], not -1"),
]


@pytest.mark.parametrize("option,message", BAD_OPTIONS, ids=[o for o, _ in BAD_OPTIONS])
def test_out_of_range_option_is_one_line_and_exit_2(option, message, capsys):
    from hpctrain.cli import main

    assert main(["train", "default", option]) == 2  # the command line's own entry point
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"error: {message}"] and captured.out == ""


def test_out_of_range_option_from_a_shell_is_one_line_and_exit_2():
    p = run(hpctrain_cmd("train", "default", "--optim.eps=-1"), timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == ["error: optim.eps must be a finite number > 0, not -1.0"]


# ---------------------------------------------------------------- train.out_dir


def test_out_dir_that_is_a_file_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "somefile").write_text("not a directory\n")
    for out_dir, message in [
            (tmp_path / "somefile", "is a file, not a directory"),
            (tmp_path / "somefile" / "sub", f"{tmp_path / 'somefile'} is a file"),
    ]:
        p = run(hpctrain_cmd("train", "default", f"--train.out_dir={out_dir}"), timeout=60)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --train.out_dir={out_dir}")
        assert message in lines[0], lines[0]
    assert (tmp_path / "somefile").read_text() == "not a directory\n"


def test_a_tensorboard_folder_that_is_a_file_or_unwritable_is_one_line_and_exit_2(
        tmp_path, capsys, monkeypatch):
    """Checked with the out_dir, before MPI: a traceback from the writer before."""
    from hpctrain.cli import main

    (tmp_path / "somefile").write_text("not a directory\n")
    argv = ["train", "default", f"--train.out_dir={tmp_path}/run"]
    assert main([*argv, f"--train.tensorboard={tmp_path}/somefile"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --train.tensorboard={tmp_path}/somefile is a file, not a "
                   "directory; name a directory (it is created if missing)\n")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == locked
                        else real_access(path, mode))
    assert main([*argv, f"--train.tensorboard={locked}/tb"]) == 2
    assert "cannot create or write files in" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not list(locked.iterdir())


def _read_only_bind(folder: Path) -> list[str] | None:
    """A command prefix that runs under a read-only bind mount of ``folder`` (a private
    mount namespace: nothing changes outside), or None where mounts are not allowed."""
    script = f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" ' \
             f'&& exec "$@"'
    prefix = ["unshare", "-m", "sh", "-c", script, "sh"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if probe.returncode == 0 else None


def test_out_dir_where_this_user_cannot_write_is_one_line_and_exit_2(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    cmd = hpctrain_cmd("train", "default", f"--train.out_dir={locked}/run")
    want = (f"error: --train.out_dir={locked}/run: cannot create or write files in {locked} "
            "(no permission, or a read-only file system); choose a directory you can "
            "write to")
    if os.geteuid() != 0:  # a folder without write permission stops everyone but root
        os.chmod(locked, 0o555)
        p = run(cmd, timeout=60)
    elif (prefix := _read_only_bind(locked)) is not None:  # root: a read-only file system
        p = run([*prefix, *cmd], timeout=60)
    else:  # root without mount rights: what the kernel would answer, in process
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == locked
                            else real_access(path, mode))
        with pytest.raises(ConfigError) as err:
            check_out_dir(f"{locked}/run")
        assert f"error: {err.value}" == want
        return
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [want]
    assert not list(locked.iterdir())


def test_check_out_dir_accepts_new_and_existing_directories(tmp_path):
    check_out_dir(str(tmp_path))
    check_out_dir(str(tmp_path / "new" / "deeper"))
    assert not (tmp_path / "new").exists()  # a check, never a mkdir


# ------------------------------------------------------------ prepare --output


@pytest.fixture
def corpus(tmp_path):
    """A few small text files (several, so that two ranks each get some)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(6):
        (folder / f"{i}.txt").write_text(f"file {i}: " + "all work and no play " * (50 * i + 1))
    return folder


def _snapshot(folder: Path) -> dict:
    """Every entry of ``folder`` with its bytes and modification time."""
    return {p.name: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in folder.iterdir()}


def test_prepare_refuses_to_replace_an_existing_file_without_overwrite(corpus, tmp_path):
    out = tmp_path / "d.h5"
    cmd = hpctrain_cmd("prepare", "--input", str(corpus), "--output", str(out))
    assert run(cmd, timeout=120).returncode == 0
    before = _snapshot(tmp_path)
    p = run(cmd, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [f"error: --output {out} exists; add --overwrite to "
                                     "replace it, or choose another name"]
    assert _snapshot(tmp_path) == before  # nothing written, renamed or left behind
    p = run([*cmd, "--overwrite"], timeout=120)
    assert p.returncode == 0 and "prepared" in p.stdout, p.stderr


def test_prepare_output_that_is_a_directory_is_one_line_and_exit_2(corpus, tmp_path):
    for flags, example in ((["--input", str(corpus)], "data.h5"),
                           (["--combine", str(tmp_path / "x.h5")], "all.json")):
        p = run(hpctrain_cmd("prepare", *flags, "--output", str(tmp_path), "--overwrite"),
                timeout=120)
        assert p.returncode == 2, p.stderr
        assert p.stderr.splitlines() == [f"error: --output {tmp_path} is a directory; name "
                                         f"the file to write, e.g. --output "
                                         f"{tmp_path}/{example}"]


def test_combine_refuses_to_replace_a_manifest_without_overwrite(corpus, tmp_path):
    from hpctrain.data.prepare import combine, prepare

    shard = prepare([corpus], tmp_path / "s.h5", show_progress=False)["output"]
    manifest = tmp_path / "all.json"
    combine([shard], manifest)
    text = manifest.read_text()
    with pytest.raises(DataError, match="exists; add --overwrite"):
        combine([shard], manifest)
    assert manifest.read_text() == text
    combine([shard], manifest, overwrite=True)


# ------------------------------------------------------------------- file modes


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    """Run the test under this umask, and restore the old one."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_prepared_files_get_the_mode_open_would_give_under_the_umask(corpus, tmp_path, umask):
    from hpctrain.data.prepare import combine, prepare

    want = {0o022: 0o644, 0o027: 0o640}[umask]
    shard = Path(prepare([corpus], tmp_path / "d.h5", show_progress=False)["output"])
    assert stat.S_IMODE(shard.stat().st_mode) == want
    combine([shard], tmp_path / "all.json")
    assert stat.S_IMODE((tmp_path / "all.json").stat().st_mode) == want


def test_job_scripts_are_executable_as_far_as_the_umask_allows(tmp_path, umask):
    from hpctrain.jobs.render import write_script

    path = write_script(tmp_path / "job.sh", "#!/bin/bash\ntrue\n")
    assert stat.S_IMODE(path.stat().st_mode) == {0o022: 0o755, 0o027: 0o750}[umask]


# ------------------------------------------------ a stalled rank in `prepare`

# Rank 1 sleeps before one collective (the test-only switch in prepare.py) or, with no
# switch at all, inside its reading of the inputs, so rank 0 waits for it in the next
# collective. With --timeout 3 the watchdog must end the job, naming the operation.
STALL_IN_READING = """\
import sys, time
import hpctrain.data.prepare_tokenize as prep
read = prep._encode_units
def stalled(tok, dtype, plan, units, *args):
    if plan.lo > 0:  # rank 1's run of units starts after rank 0's
        time.sleep(3600)
    return read(tok, dtype, plan, units, *args)
prep._encode_units = stalled
from hpctrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stall_at,waits_in", [
    (None, "prepare: reading the inputs (error check)"),
    ("file list", "prepare: file list (error check)"),
    ("vocabulary", "prepare: vocabulary"),
    ("write round 1", "prepare: write round 1 of 2 (Iwrite_at_all)"),
    ("barrier before closing", "prepare: barrier before closing the file"),
])
def test_a_stalled_rank_ends_prepare_through_the_watchdog_naming_the_operation(
        corpus, tmp_path, stall_at, waits_in):
    from hpctrain.data.mpiio import mpiio_component
    from tests.helpers import launcher, mpiexec

    out = tmp_path / "d.h5"
    if stall_at is None:
        (tmp_path / "stall.py").write_text(STALL_IN_READING)
        # PYTHONPATH: a script in tmp_path would import the installed hpctrain, not ours
        cmd, env = [sys.executable, str(tmp_path / "stall.py")], {"PYTHONPATH": str(REPO)}
    else:
        cmd = [sys.executable, "-m", "hpctrain"]
        env = {"HPCTRAIN_TEST_STALL_PREPARE_RANK": "1",
               "HPCTRAIN_TEST_STALL_PREPARE_AT": stall_at}
    # The watchdog (--timeout 3) ends the job; a hang instead runs into run()'s limit,
    # which fails the test (no assertion on the clock: a loaded machine is slow).
    p = run(mpiexec(2, *cmd, "prepare", "--input", str(corpus), "--output", str(out),
                    "--timeout", "3"), timeout=90, env=env)
    assert p.returncode != 0, p.stderr
    if (stall_at == "write round 1" and launcher().family == "openmpi"
            and mpiio_component("Open MPI")[0] == "OMPIO"):
        # Open MPI's OMPIO completes rank 0's part of a nonblocking collective write
        # without rank 1 (seen with 4.1.4): rank 0 then waits at the next collective.
        waits_in = "prepare: barrier before syncing the file"
    assert f"CommTimeout: {waits_in} did not complete within 3 s (--timeout)" in p.stderr, \
        p.stderr
    assert not out.exists()


@pytest.mark.slow  # starts a process and stops it while it tokenizes
def test_sigterm_during_prepare_removes_its_spill_files(tmp_path):
    """The default action of SIGTERM left each rank's hidden spill file (about 100 MB
    a rank); prepare now ends like Ctrl-C: exit 143, one line, nothing left behind."""

    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.Popen(hpctrain_cmd("prepare", "--corpus", "stdlib", "--max-bytes",
                                      "40000000", "--output", str(out / "d.h5")),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(2400):  # polled until the spill file is there (at most 2 min)
            if [f for f in out.iterdir() if f.name.startswith(".")] or p.poll() is not None:
                break
            time.sleep(0.05)
        assert p.poll() is None, "prepare ended before its spill file was seen"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("prepare: stopped by SIGTERM"), err
    assert list(out.iterdir()) == []

