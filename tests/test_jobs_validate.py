"""A job's request checked before anything is written: bad requests name the fix, the
training layout against the job's ranks, every queue limit as the sites' guides state it."""

from __future__ import annotations

import pytest

from hpctrain.errors import JobError
from hpctrain.jobs.render import render
from hpctrain.jobs.spec import build_spec
from hpctrain.systems.registry import load_system
from tests.jobs_common import CLUSTERS, CMD, directives, script


# ------------------------------------------------------------------------------ checks

@pytest.mark.parametrize("kw, message", [
    (dict(queue="debug", nodes=4), "queue debug on polaris takes at most 2 node(s), you asked "
                                   "for 4: use --nodes 2 or another queue; queues that take 4 "
                                   "node(s) for 00:30:00: debug-scaling, preemptable, capacity"),
    (dict(queue="prod", nodes=4), "takes at least 10 nodes, you asked for 4: use --nodes 10"),
    (dict(queue="debug", walltime="02:00:00"), "allows at most 01:00:00 for 2 node(s), you "
                                               "asked for 02:00:00: use --walltime 01:00:00"),
    (dict(queue="gpu"), "polaris has no queue 'gpu'; use one of: debug (1-2 nodes"),
    (dict(walltime="30:00"), "is not HH:MM:SS"),
    (dict(walltime="00:61:00"), "is not HH:MM:SS"),
    (dict(walltime="00:00:00"), "longer than 00:00:00"),
    (dict(nodes=0), "at least 1 node"),
    (dict(account=None), "polaris needs --account"),
    (dict(queue=None), "polaris needs --queue NAME (one of: debug"),
    (dict(walltime=None), "polaris needs --walltime"),
    (dict(filesystems=["home:grand"]), "no filesystem 'grand'; valid: home, eagle"),
    (dict(queue="prod", nodes=10, array="0-99"), "need a %N throttle with N <= 10"),
    (dict(queue="prod", nodes=10, array="0-99%20"), "need a %N throttle with N <= 10"),
    (dict(array="3-3"), "START < END"),
    (dict(array="1,2,3"), "PBS arrays are START-END"),
    (dict(ranks_per_node=0), "use at least 1"),
    (dict(ranks_per_node=64), "more than the 32 CPUs"),
    (dict(env=["1BAD=x"]), "expected KEY=VALUE"),
    (dict(env=["NOVALUE"]), "expected KEY=VALUE"),
    (dict(command=["prepare", "--corpus", "stdlib"]), "after '--' comes an hpctrain command"),
    (dict(command=[]), "name the command to run after '--'"),
    (dict(command=["train"]), "name a recipe after 'train'"),
    (dict(command=["train", "nosuch"]), "unknown recipe 'nosuch'"),
    (dict(command=CMD + ["--train.max_iter=5"]), "did you mean --train.max_iters?"),
    (dict(command=CMD + ["--train.out_dir=/x"]), "drop --train.out_dir: a job writes into"),
    (dict(profiler="nsys", system="aurora", nodes=2, queue="debug"), "not available on aurora"),
])
def test_bad_requests_fail_with_a_message_that_names_the_fix(kw, message):
    args = {"system": "polaris", **CLUSTERS["polaris"], "command": CMD, **kw}
    with pytest.raises(JobError) as e:
        build_spec(**args)
    assert message in str(e.value)


def test_no_queue_check_lets_a_site_change_its_limits():
    spec = build_spec(system="polaris", command=CMD, check_queue=False,
                      **{**CLUSTERS["polaris"], "nodes": 4, "queue": "newqueue"})
    assert "#PBS -q newqueue" in render(spec) and "--no-queue-check" in spec.argv()


def test_frontier_walltime_depends_on_job_size():
    with pytest.raises(JobError, match="at most 02:00:00 for 2 node"):
        build_spec(system="frontier", command=CMD,
                   **{**CLUSTERS["frontier"], "walltime": "04:00:00"})
    build_spec(system="frontier", command=CMD, **{**CLUSTERS["frontier"], "nodes": 200,
                                                  "walltime": "12:00:00"})


def test_the_training_layout_is_checked_against_the_jobs_ranks():
    # Polaris: 4 ranks per node. 2 nodes = 8 ranks: pp=4 fits, pp=3 does not.
    polaris = {**CLUSTERS["polaris"], "nodes": 2}
    build_spec(system="polaris", command=[*CMD, "--parallel.pp=4", "--train.batch_size=12"],
               **polaris)
    with pytest.raises(JobError, match=r"8 rank\(s\) cannot form pipelines of --parallel.pp=3"):
        build_spec(system="polaris", command=[*CMD, "--parallel.pp=3"], **polaris)
    with pytest.raises(JobError, match="cannot be split evenly over 8"):
        build_spec(system="polaris", command=[*CMD, "--train.batch_size=12"], **polaris)
    # --ranks-per-node changes the count: 2 nodes x 3 ranks take pp=3.
    build_spec(system="polaris", command=[*CMD, "--parallel.pp=3", "--train.batch_size=12"],
               **{**polaris, "ranks_per_node": 3})


# ------------------------------------------------------------ queue rules (issue C)

def _spec(system, **kw):
    """A request whose global batch splits over its ranks, however many."""
    per_node = kw.get("ranks_per_node") or load_system(system).launch.ranks_per_node
    ranks = kw.get("nodes", 1) * per_node
    return build_spec(system=system, command=[*CMD[:3], f"--train.batch_size={ranks}"],
                      account="P", **kw)


@pytest.mark.parametrize("nodes, edge", [(10, "03:00:00"), (24, "03:00:00"), (25, "06:00:00"),
                                         (99, "06:00:00"), (100, "24:00:00"),
                                         (496, "24:00:00")])
def test_polaris_prod_walltime_by_routed_queue(nodes, edge):
    # ALCF user guide, Polaris "Running Jobs": prod routes to small (10-24 nodes, 3 h),
    # medium (25-99, 6 h), large (100-496, 24 h).
    _spec("polaris", queue="prod", nodes=nodes, walltime=edge)
    h, m, s = edge.split(":")
    with pytest.raises(JobError, match=rf"prod on polaris allows at most {edge} for {nodes} "):
        _spec("polaris", queue="prod", nodes=nodes, walltime=f"{h}:{m}:01")


@pytest.mark.parametrize("nodes, edge", [(256, "12:00:00"), (1024, "12:00:00"),
                                         (1025, "18:00:00"), (1999, "18:00:00"),
                                         (2000, "24:00:00")])
def test_aurora_prod_walltime_by_size(nodes, edge):
    _spec("aurora", queue="prod", nodes=nodes, walltime=edge)
    with pytest.raises(JobError, match=rf"prod on aurora allows at most {edge} for {nodes} "):
        _spec("aurora", queue="prod", nodes=nodes, walltime=edge[:-2] + "01")


@pytest.mark.parametrize("system, queue", [
    (s, q) for s in ("polaris", "aurora") for q in load_system(s).batch.queues])
def test_every_alcf_queue_has_a_five_minute_minimum(system, queue):
    nodes = max(load_system(system).batch.queues[queue].min_nodes, 1)
    _spec(system, queue=queue, nodes=nodes, walltime="00:05:00")
    with pytest.raises(JobError, match=rf"queue {queue} on {system} takes jobs of at least "
                                       r"00:05:00, you asked for 00:04:59"):
        _spec(system, queue=queue, nodes=nodes, walltime="00:04:59")


@pytest.mark.parametrize("system, queue, limit", [
    ("polaris", "debug", 1), ("polaris", "debug-scaling", 1), ("polaris", "preemptable", 20),
    ("polaris", "prod", 10), ("aurora", "debug", 1), ("aurora", "debug-scaling", 1),
    ("aurora", "prod", 10)])
def test_alcf_array_throttle_per_queue_and_rerunnable_arrays(system, queue, limit):
    # ALCF user guide, "Example Job Scripts" > "Limits on job arrays" and each system's
    # "Running Jobs" queue table: sub-jobs count against the queue's concurrent-job limit.
    q = load_system(system).batch.queues[queue]
    kw = dict(queue=queue, nodes=q.min_nodes, walltime="00:30:00")
    text = render(_spec(system, array=f"0-31%{limit}", **kw))
    assert f"#PBS -J 0-31%{limit}" in directives(text)
    assert directives(text).count("#PBS -r y") == 1  # PBS reruns array sub-jobs
    with pytest.raises(JobError, match=rf"queue {queue} need a %N throttle with N <= {limit}"):
        _spec(system, array=f"0-31%{limit + 1}", **kw)
    with pytest.raises(JobError, match=rf"queue {queue} need a %N throttle with N <= {limit}"):
        _spec(system, array="0-31", **kw)


def test_every_pbs_array_is_rerunnable():
    for system, kw in (("pbs", dict(walltime="01:00:00")),
                       ("polaris", dict(queue="capacity", nodes=1, walltime="01:00:00")),
                       ("aurora", dict(queue="capacity", nodes=1, walltime="00:30:00"))):
        text = render(_spec(system, array="0-3", **kw))
        assert "#PBS -J 0-3" in directives(text) and "#PBS -r y" in directives(text), system
    assert "#PBS -r y" not in script("pbs")  # not without an array


# Every queue limit of the site systems, as the sites' guides state it; the system files'
# comments cite the guide, section and the commit of the copy read. A row: system, queue,
# [min, max] nodes, max walltime at the largest job, the smaller jobs' tighter limits,
# min walltime, array throttle.
SOURCED_QUEUES = [
    # ALCF user guide, Polaris "Running Jobs" > "Queues" (queue and prod routing tables);
    # "Example Job Scripts" > "Limits on job arrays".
    ("polaris", "debug", [1, 2], "01:00:00", (), "00:05:00", 1),
    ("polaris", "debug-scaling", [1, 10], "01:00:00", (), "00:05:00", 1),
    ("polaris", "prod", [10, 496], "24:00:00",
     ((24, "03:00:00"), (99, "06:00:00"), (496, "24:00:00")), "00:05:00", 10),
    ("polaris", "preemptable", [1, 10], "72:00:00", (), "00:05:00", 20),
    ("polaris", "capacity", [1, 4], "168:00:00", (), "00:05:00", None),
    # ALCF user guide, Aurora "Running Jobs on Aurora" > "Queues"; "Known Issues" > "Job
    # Array Submitted to prod Never Runs".
    ("aurora", "debug", [1, 2], "01:00:00", (), "00:05:00", 1),
    ("aurora", "debug-scaling", [2, 256], "01:00:00", (), "00:05:00", 1),
    ("aurora", "prod", [256, 10624], "24:00:00",
     ((1024, "12:00:00"), (1999, "18:00:00"), (10624, "24:00:00")), "00:05:00", 10),
    ("aurora", "capacity", [1, 16], "168:00:00", (), "00:05:00", None),
    # OLCF Frontier user guide, "Scheduling Policy": "Job Priority by Node Count",
    # "extended Partition (queue) Policy", "debug Quality of Service Class".
    ("frontier", "batch", [1, 9472], "12:00:00",
     ((91, "02:00:00"), (183, "06:00:00"), (9472, "12:00:00")), None, None),
    ("frontier", "debug", [1, 9472], "02:00:00", (), None, None),
    ("frontier", "extended", [1, 64], "24:00:00", (), None, None),
    # NERSC "QOSes and Charges" (docs.nersc.gov/jobs/policy/): unverified, see
    # perlmutter.toml; the walltimes agree with sacctmgr output quoted elsewhere.
    ("perlmutter", "debug", [1, 8], "00:30:00", (), None, None),
    ("perlmutter", "regular", [1, 1536], "48:00:00", (), None, None),
]


def _seconds(hms):
    h, m, s = (int(x) for x in hms.split(":"))
    return h * 3600 + m * 60 + s


def _plus_one_second(hms):
    s = _seconds(hms) + 1
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def test_the_systems_hold_exactly_the_sourced_queues():
    rows = {(s, q): row for s, q, *row in SOURCED_QUEUES}
    for system in ("polaris", "aurora", "frontier", "perlmutter"):
        for name, q in load_system(system).batch.queues.items():
            assert (system, name) in rows, f"{system} {name}: add its source to SOURCED_QUEUES"
            nodes, wall, by_nodes, min_wall, throttle = rows[system, name]
            assert [q.min_nodes, q.max_nodes] == nodes, (system, name)
            assert q.max_walltime == _seconds(wall), (system, name)
            assert q.walltime_by_nodes == tuple((n, _seconds(w)) for n, w in by_nodes)
            assert q.min_walltime == (_seconds(min_wall) if min_wall else 0), (system, name)
            assert q.array_throttle == throttle, (system, name)
    assert len(rows) == sum(len(load_system(s).batch.queues)
                            for s in ("polaris", "aurora", "frontier", "perlmutter"))


@pytest.mark.parametrize("system, queue, nodes, wall", [
    (s, q, n, w) for s, q, n, w, *_ in SOURCED_QUEUES])
def test_each_queue_takes_its_largest_job_and_refuses_one_node_more(system, queue, nodes,
                                                                     wall):
    _spec(system, queue=queue, nodes=nodes[1], walltime=wall)
    with pytest.raises(JobError, match=rf"queue {queue} on {system} takes at most "
                                       rf"{nodes[1]} node\(s\), you asked for {nodes[1] + 1}"):
        _spec(system, queue=queue, nodes=nodes[1] + 1, walltime="00:30:00")
    if nodes[0] > 1:
        _spec(system, queue=queue, nodes=nodes[0], walltime="00:30:00")
        with pytest.raises(JobError, match=rf"queue {queue} on {system} takes at least "
                                           rf"{nodes[0]} nodes, you asked for {nodes[0] - 1}"):
            _spec(system, queue=queue, nodes=nodes[0] - 1, walltime="00:30:00")


@pytest.mark.parametrize("system, queue, nodes, wall", [
    (s, q, n, w) for s, q, n, w, *_ in SOURCED_QUEUES])
def test_each_queue_takes_its_walltime_limit_and_refuses_a_second_more(system, queue, nodes,
                                                                       wall):
    _spec(system, queue=queue, nodes=nodes[0], walltime=_limit_for(system, queue, nodes[0]))
    _spec(system, queue=queue, nodes=nodes[1], walltime=wall)
    with pytest.raises(JobError, match=rf"queue {queue} on {system} allows at most {wall} "
                                       rf"for {nodes[1]} node\(s\), you asked for "
                                       rf"{_plus_one_second(wall)}"):
        _spec(system, queue=queue, nodes=nodes[1], walltime=_plus_one_second(wall))


def _limit_for(system, queue, n):
    row = next(r for r in SOURCED_QUEUES if r[:2] == (system, queue))
    return next((w for most, w in row[4] if n <= most), row[3])


def test_perlmutter_qos_it_does_not_model_need_no_queue_check():
    with pytest.raises(JobError, match=r"perlmutter has no queue 'premium'; use one of: "
                                       r"debug \(1-8 nodes, <= 00:30:00\); regular "
                                       r"\(1-1536 nodes, <= 48:00:00\) \(or --no-queue-check"):
        _spec("perlmutter", queue="premium", nodes=2, walltime="01:00:00")
    text = render(_spec("perlmutter", queue="premium", nodes=2, walltime="01:00:00",
                        check_queue=False))
    assert "#SBATCH --qos=premium" in directives(text)


def test_frontier_largest_job_debug_qos_and_ranks_per_node():
    kw = dict(walltime="12:00:00", queue="batch")
    _spec("frontier", nodes=9472, **kw)
    with pytest.raises(JobError, match="takes at most 9472 node"):
        _spec("frontier", nodes=9473, **kw)
    text = render(_spec("frontier", nodes=4, queue="debug", walltime="02:00:00"))
    assert "#SBATCH -p batch" in directives(text) and "#SBATCH -q debug" in directives(text)
    assert "#SBATCH -p debug" not in text  # debug is a QOS, not a partition
    with pytest.raises(JobError, match="queue debug on frontier allows at most 02:00:00"):
        _spec("frontier", nodes=4, queue="debug", walltime="02:00:01")
    _spec("frontier", nodes=2, queue="batch", walltime="01:00:00", ranks_per_node=8)
    with pytest.raises(JobError, match="a frontier node takes at most 8 ranks"):
        _spec("frontier", nodes=2, queue="batch", walltime="01:00:00", ranks_per_node=9)


def test_a_data_path_missing_here_is_a_warning_and_a_present_one_none(tmp_path, monkeypatch):
    """A typo in --data.path was found only after the queue wait; a path that exists only
    on the compute nodes must still be allowed, so it is a warning, not an error."""
    from hpctrain.jobs.command import data_warnings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.h5").write_bytes(b"")
    assert data_warnings(["train", "default", "--data.path=here.h5"]) == ()
    (warning,) = data_warnings(["train", "default", "--data.path=there.h5"])
    assert warning.startswith("--data.path there.h5 does not exist on this machine")
    assert data_warnings(["doctor"]) == ()
