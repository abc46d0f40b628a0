"""The push's threads: the synchronous push's sender (bucket k on the wire while bucket k+1 is
built) and the overlapped push's flight (``weights.overlap``: the buckets staged on the trainer's
thread, then sent and published on a thread of its own while the trainer computes the next
update)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from megarl.weights.resharder import Bucket, ReshardTimes


def stage_buckets(resharder, skip: frozenset, ps, agree: Callable) -> tuple[list[Bucket], ReshardTimes]:
    """An overlapped push's step 2 on the trainer's thread: this stage's buckets gathered (the TP
    group's collectives stay on the thread that trains), converted and copied (the resharder
    yields views of the parameters where no conversion was needed, and the next update writes
    them), stage by stage with an agreement after each; the source keeps them until its flight
    has sent them."""
    staged: list[Bucket] = []
    times = ReshardTimes()
    for stage in range(ps.pp):
        err = None
        if ps.pp_rank == stage:
            try:
                for bucket in resharder.iter_buckets(skip):
                    staged.append(Bucket(bucket.names, [t.detach().clone() for t in bucket.tensors]))
                times = resharder.times
            except Exception as e:  # noqa: BLE001 - agreed below
                err = e
        agree(err)
    return staged, times


FLIGHT_THREAD = "megarl-push-v"  # a flight's thread name: this, then its version


class Flight:
    """One overlapped push in the air: ``fly(version, *args)`` on a thread of its own. ``frozen``:
    the rows frozen when it was staged (the delta bookkeeping takes them once it lands)."""

    def __init__(self, fly: Callable, version: int, frozen: frozenset, *args):
        self.version, self.frozen = version, frozen
        self._out, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fly, (version, *args)),
                                        name=f"{FLIGHT_THREAD}{version}", daemon=True)
        self._thread.start()

    def _run(self, fly: Callable, args: tuple) -> None:
        try:
            self._out = fly(*args)
        except BaseException as e:  # noqa: BLE001 - raised on the trainer's thread by result()
            self._error = e

    def result(self, timeout_s: float):
        """The flight's return value, or its exception raised here."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"weights.timeout_s: the overlapped push of version {self.version} did not "
                               f"end within {timeout_s:g} s (every step of it has a deadline: see the log)")
        if self._error is not None:
            raise self._error
        return self._out


# Buckets alive at once during step 2: the one on the wire and the one being built. A third would
# only help if building a bucket took longer than sending it, at one more bucket of memory.
PIPELINE_DEPTH = 2


class Sender:
    """One background thread that sends buckets in submission order (the servers receive
    announces in that order: one HTTP call at a time per server). Collectives on the weight-update
    group run only here, on the TP group only on the caller's thread, so they never interleave."""

    def __init__(self, transport, version: str, record: Optional[Callable] = None,
                 forget: Optional[Callable] = None):
        self.transport, self.version, self.record, self.forget = transport, version, record, forget
        self.slots = threading.Semaphore(PIPELINE_DEPTH)
        self.error: Optional[BaseException] = None
        self.busy_s = 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megarl-push")

    def submit(self, bucket) -> None:
        self._pool.submit(self._run, bucket)

    def _run(self, bucket) -> None:
        try:
            if self.error is None:  # after a failure: skip, the caller reports the first error
                ts = time.perf_counter()
                try:
                    self.transport.send(bucket, self.version)
                finally:
                    self.busy_s += time.perf_counter() - ts
                if self.record is not None:
                    self.record(bucket)
                elif self.forget is not None:
                    self.forget(bucket)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's agreement step
            self.error = e
        finally:
            self.slots.release()  # the bucket's tensors are dropped with this frame

    def close(self) -> None:
        self._pool.shutdown(wait=True)
