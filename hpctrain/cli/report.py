"""``hpctrain report RUN [RUN ...] [--out DIR]``: plots of one or several runs and one
HTML page with them embedded (``hpctrain/report/``). Reads only the runs' files; needs
neither torch nor MPI."""

from __future__ import annotations


def add_report(sub) -> None:
    p = sub.add_parser("report", help="plots and an HTML page of training runs",
                       description="Draw loss against step and time, throughput and MFU, "
                                   "the step's phases and memory per rank of one or several "
                                   "runs (overlaid), from their metrics.jsonl and "
                                   "summary.json, and the top kernels and idle share of "
                                   "each rank's --train.profile trace; works while a run "
                                   "is still going and joins a resumed run's segments.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run's --train.out_dir")
    p.add_argument("--out", default=None, help="folder for report.html and plots/ "
                                               "(default: RUN/report; required for several "
                                               "runs)")


def cmd_report(args) -> int:
    from hpctrain.report.page import build_report

    page = build_report(args.runs, args.out, log=print)
    print(f"report: {page} (plots in {page.parent / 'plots'})")
    return 0
