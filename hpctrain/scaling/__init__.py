"""Scaling studies and the performance model.

spec.py (sweep spec -> points) -> runner.py (runs, one JSON record each; records.py)
-> study_report.py + plots.py (Markdown/HTML, PNG). emit.py writes job scripts instead of
running. perfmodel.py predicts step time and memory from a system's performance figures
(system_perf.py: the ``[perf]`` table of ``hpctrain/systems/<name>.toml`` with a
calibration on top; comm_cost.py: alpha-beta costs of the collectives) that calibrate.py
measures on this machine; planner.py ranks parallel arrangements with it.
"""
