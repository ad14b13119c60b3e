"""Which MPI-IO implementation reads (hpctrain/data/mpiio.py ``mpiio_component``), in
one process: Open MPI's ``io`` parameter from the environment or a parameter file, and
ROMIO for every other library. The start-up line and ``perf/bench_io.py`` report it."""

from __future__ import annotations

import pytest

from hpctrain.data.mpiio import describe_reader, mpiio_component


@pytest.mark.parametrize("value,component", [
    (None, "OMPIO"), ("romio321", "ROMIO"), ("romio341", "ROMIO"), ("^ompio", "ROMIO"),
    ("ompio", "OMPIO"), ("ompio,romio321", "OMPIO"), ("^romio321", "OMPIO")])
def test_open_mpi_io_parameter_picks_the_component(value, component, tmp_path):
    env = {"OMPI_MCA_mca_base_param_files": str(tmp_path / "none.conf")}
    if value is not None:
        env["OMPI_MCA_io"] = value
    got, why = mpiio_component("Open MPI v4.1.4", env)
    assert got == component
    assert (value or "default") in why


def test_open_mpi_io_parameter_from_a_parameter_file(tmp_path):
    conf = tmp_path / "mca-params.conf"
    conf.write_text("# site settings\nbtl = ^openib\nio = romio321  # faster small reads\n")
    got, why = mpiio_component("Open MPI v4.1.4",
                               {"OMPI_MCA_mca_base_param_files": str(conf)})
    assert got == "ROMIO" and str(conf) in why


def test_other_libraries_read_through_romio():
    for library in ("MPICH Version: 4.2.0", "MPI VERSION    : CRAY MPICH version 8.1.28",
                    "Intel(R) MPI Library 2021.10"):
        assert mpiio_component(library, {"OMPI_MCA_io": "ompio"})[0] == "ROMIO"


def test_the_start_up_description_names_the_reader_and_whether_hints_apply(monkeypatch):
    class MPIReader:
        hints = {"romio_cb_read": "disable"}

    monkeypatch.setattr("hpctrain.data.mpiio.library_name", lambda: "Open MPI v4.1.4")
    monkeypatch.setenv("OMPI_MCA_mca_base_param_files", "/nonexistent")
    monkeypatch.delenv("OMPI_MCA_io", raising=False)
    assert "through OMPIO" in describe_reader(MPIReader())
    assert "OMPI_MCA_io=romio321" in describe_reader(MPIReader())
    monkeypatch.setenv("OMPI_MCA_io", "romio321")
    assert describe_reader(MPIReader()).endswith("hints romio_cb_read=disable")
    assert "no MPI-IO" in describe_reader(object())
