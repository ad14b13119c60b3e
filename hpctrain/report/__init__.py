"""``hpctrain report RUN [RUN ...]``: a run's plots and one self-contained HTML page, from
what the run wrote (``metrics.jsonl``, ``summary.json``); no torch, no MPI."""
