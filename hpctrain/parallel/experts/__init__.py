"""Expert parallelism's token exchange: each rank's routed token copies go to the ranks
holding their experts and the experts' outputs come back (dispatch and combine, the
counts exchanged first, as Megatron-LM's all-to-all token dispatcher does).

``permute.py``: the pure index arithmetic; ``alltoall.py``: the all-to-all as an autograd
function and its MPI transport; ``device_alltoall.py``: the device library's transport;
``dispatch.py``: ``LocalDispatch`` and ``ExpertParallelDispatch``.
"""
