"""Expert parallelism's rows on the device library (``--comm.transport=xccl``):
``torch.distributed.all_to_all_single`` with split sizes over the group's ``experts``
process group (NCCL, XCCL; gloo on the host). The counts still go over MPI
(``AllToAll.counts``).

On a GPU the exchange is ordered on the current stream (``work.wait()`` makes the stream
wait, the host does not); a host backend reads the memory at once, so the host first
waits for the event behind the rows' last write, and waits for the work with the
run's deadline.
"""

from __future__ import annotations

import datetime

from hpctrain.errors import CommTimeout
from hpctrain.parallel.experts.alltoall import AllToAll, received_like

EXPERT_GROUP = "experts"
"""The purpose of the device library's process groups of expert parallelism
(``comm/device_collectives.make_groups``, made by every rank of the job)."""


class DeviceAllToAll(AllToAll):
    """Rows by ``all_to_all_single`` over the group's ``experts`` process group."""

    def __init__(self, comm, **kwargs):
        super().__init__(comm, **kwargs)
        from hpctrain.comm.device_collectives import group_for

        self.group = group_for(comm, EXPERT_GROUP)
        self._stream_ordered = self.accel is not None and self.accel.kind in ("cuda", "xpu")

    def rows(self, x, send_rows, recv_rows, what):
        import torch.distributed as dist

        x = x.detach().contiguous()
        if self.accel is not None and self.accel.holds(x) and not self._stream_ordered:
            ready = self.accel.event().record()
            ready.wait()  # a host backend reads the memory now
            self.accel.note_handoff(True, ready)
        received = received_like(x, recv_rows)
        work = dist.all_to_all_single(received, x, output_split_sizes=recv_rows,
                                      input_split_sizes=send_rows, group=self.group,
                                      async_op=True)
        self._wait(work, what)
        return received

    def _wait(self, work, what: str) -> None:
        if self._stream_ordered:
            work.wait()
            return
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as err:
            raise CommTimeout(
                f"{self._what(what)} did not complete within {self.timeout:g} s "
                "(--comm.timeout): another rank is stuck, dead, or skipped this "
                f"operation ({str(err).splitlines()[0][-200:]})") from err
