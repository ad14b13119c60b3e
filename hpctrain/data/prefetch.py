"""Read the next batch while the current one computes: one background reader thread.

The samplers are pure functions of (seed, step), so the trainer knows step s+1's windows
while step s computes and submits that read at once. All reads of a dataset, prefetched
or not, go through the same single thread in the order they were submitted: collective
reads then reach MPI in the same order on every rank, whatever the training thread does
(evaluations in between included). Waiting for a read has a deadline, like every wait.

The thread calls MPI while the training thread does too, which needs MPI initialized with
``MPI_THREAD_MULTIPLE`` (mpi4py's default); with less, reads run in the calling thread.
"""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np

from hpctrain.errors import CommTimeout


class Prefetcher:
    """Wraps a reader (``read``, ``splits``, ``tokenizer``, ... pass through)."""

    def __init__(self, reader, *, timeout: float, threaded: bool = True):
        self.reader = reader
        self.timeout = timeout
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="hpctrain-reader") \
            if threaded else None

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def submit(self, fn, *args, **kwargs) -> cf.Future:
        """Run ``fn(*args, **kwargs)`` (a read, and whatever turns it into a batch) in the
        reader thread after everything submitted before; the result is ``wait(future)``."""
        if self._pool is not None:
            return self._pool.submit(fn, *args, **kwargs)
        future: cf.Future = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # re-raised by wait(), as from the thread
            future.set_exception(exc)
        return future

    def wait(self, future: cf.Future, what: str = "a data read") -> np.ndarray:
        try:
            return future.result(timeout=self.timeout)
        except cf.TimeoutError:
            raise CommTimeout(f"{what} did not complete within {self.timeout:g} s "
                              "(--comm.timeout): the file system or another rank is stuck") \
                from None

    def read(self, split: str, starts, length: int, **kwargs) -> np.ndarray:
        """The reader's ``read``, in its turn in the reader thread."""
        starts = np.array(starts, dtype=np.int64)  # a copy: the caller may reuse its array
        return self.wait(self.submit(self.reader.read, split, starts, length, **kwargs),
                         f"reading {split} data")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.reader.close()

    def __getattr__(self, name):
        return getattr(self.reader, name)
