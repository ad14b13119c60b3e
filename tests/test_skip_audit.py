"""The skip audit's logic on small hand-written JUnit reports, and the MPI runner's
rank-0-only report option."""

import pytest

from tests.mpi_pytest import without_junitxml
from tests.skip_audit import Outcome, audit, main, read_allowlist, read_leg


def _report(tmp_path, leg, cases):
    """A pytest-style JUnit file; each case is (classname, name, inner XML)."""
    body = "".join(f'<testcase classname="{c}" name="{n}" time="0.1">{inner}</testcase>'
                   for c, n, inner in cases)
    path = tmp_path / f"{leg}.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}'
                    "</testsuite></testsuites>")
    return path


def _skip(reason):
    return f'<skipped type="pytest.skip" message="{reason}">tests/x.py:1: {reason}</skipped>'


def test_read_leg_gives_each_test_its_outcome_and_the_worst_of_duplicates(tmp_path):
    path = _report(tmp_path, "unit", [
        ("tests.test_a", "test_ok", ""),
        ("tests.test_a", "test_skip[1]", _skip("needs a GPU")),
        ("tests.test_a", "test_xf", '<skipped type="pytest.xfail" message="known"/>'),
        ("tests.test_a", "test_bad", '<failure message="assert 1 == 2">...</failure>'),
        ("tests.test_a", "test_teardown", ""),
        ("tests.test_a", "test_teardown", '<error message="teardown boom"/>'),
    ])
    assert read_leg(path) == {
        "tests.test_a::test_ok": Outcome("passed"),
        "tests.test_a::test_skip[1]": Outcome("skipped", "needs a GPU"),
        "tests.test_a::test_xf": Outcome("xfailed", "known"),
        "tests.test_a::test_bad": Outcome("failed", "assert 1 == 2"),
        "tests.test_a::test_teardown": Outcome("failed", "teardown boom"),
    }


def test_a_test_skipped_in_every_leg_is_never_run_unless_another_leg_runs_it():
    legs = {
        "unit": {"m::mpi_test": Outcome("skipped", "need --with-mpi option to run"),
                 "m::plain": Outcome("passed"),
                 "m::nowhere": Outcome("skipped", "not here"),
                 "m::xf": Outcome("xfailed", "known")},
        "mpi2": {"m::mpi_test": Outcome("passed"),
                 "m::plain": Outcome("skipped", "test does not use mpi"),
                 "m::nowhere": Outcome("skipped", "nor here")},
    }
    a = audit(legs)
    assert a.never_run == {"m::nowhere": {"unit": "not here", "mpi2": "nor here"}}
    assert not a.ok and a.unexplained == ["m::nowhere"]
    assert a.counts["unit"] == {"passed": 1, "failed": 0, "skipped": 2, "xfailed": 1}
    assert a.reasons["mpi2"] == {"test does not use mpi": 1, "nor here": 1}


def test_allow_list_excuses_only_what_it_names_and_reports_unused_entries(tmp_path):
    allow_file = tmp_path / "allow.txt"
    allow_file.write_text("# comment\n\nm::cuda_*   needs a CUDA device\nm::gone  stale\n")
    allow = read_allowlist(allow_file)
    assert allow == {"m::cuda_*": "needs a CUDA device", "m::gone": "stale"}
    legs = {"unit": {"m::cuda_a": Outcome("skipped", "no GPU"), "m::x": Outcome("passed")}}
    a = audit(legs, allow)
    assert a.ok and a.allowed == {"m::cuda_a": "needs a CUDA device"}
    assert a.unused == ["m::gone"]
    allow_file.write_text("m::no_reason\n")
    with pytest.raises(ValueError, match="needs a reason"):
        read_allowlist(allow_file)


def test_failures_and_missing_legs_fail_the_audit():
    a = audit({"unit": {"m::t": Outcome("failed", "boom")}}, expect=("unit", "hf"))
    assert a.failed == [("unit", "m::t", "boom")] and a.missing == ["hf"] and not a.ok


def test_main_prints_counts_and_reasons_and_sets_the_exit_status(tmp_path, capsys):
    reports = tmp_path / "reports"
    reports.mkdir()
    _report(reports, "unit", [("m", "a", ""), ("m", "b", _skip("need --with-mpi"))])
    _report(reports, "mpi2", [("m", "a", _skip("test does not use mpi")), ("m", "b", "")])
    empty = tmp_path / "none.txt"
    empty.write_text("")
    assert main([str(reports), "--allow", str(empty), "--expect", "unit,mpi2"]) == 0
    out = capsys.readouterr().out
    assert out.index("\nunit ") < out.index("\nmpi2 ")  # the legs in the order expected
    assert "need --with-mpi" in out and "skip audit: OK" in out
    _report(reports, "hf", [("m", "c", _skip("no transformers"))])
    assert main([str(reports), "--allow", str(empty)]) == 1
    out = capsys.readouterr().out
    assert "never run in any leg:\n  m::c\n      hf: no transformers" in out
    assert "skip audit: FAILED: 1 test(s) never run" in out
    assert main([str(tmp_path / "nothing")]) == 1


def test_only_rank_0_keeps_the_junit_option():
    args = ["-q", "--junitxml=r.xml", "--only-mpi", "--junit-xml", "r.xml", "tests"]
    assert without_junitxml(args) == ["-q", "--only-mpi", "tests"]
