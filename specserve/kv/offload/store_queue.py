"""Blocks on their way into the tiers: a worker thread waits for each job's device->host copy, then
puts the payloads into the tiers, off the engine's step. Until a payload is in a tier,
`pending(key)` is true and readers call `wait_for(key)`."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.kv.offload.base import BlockKey
from specserve.kv.offload.payload import PackedPayload
from specserve.kv.offload.transfer import HostRows

logger = logging.getLogger(__name__)

PutMany = Callable[[list[BlockKey], list[PackedPayload]], None]


@dataclass(eq=False)
class _Job:
    keys: list[BlockKey]
    rows: HostRows | None
    payloads: list[PackedPayload] | None
    put: PutMany
    done: threading.Event = field(default_factory=threading.Event)


class StoreQueue:
    """One worker thread, jobs in submission order."""

    def __init__(self) -> None:
        self._inflight: dict[BlockKey, _Job] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="specserve-kv-store", daemon=True)
        self._worker.start()

    def submit(self, keys: list[BlockKey], data: HostRows | list[PackedPayload], put: PutMany) -> None:
        """put(keys, payloads) in the background; HostRows once the copy that fills them completes."""
        rows = data if isinstance(data, HostRows) else None
        job = _Job(keys, rows, None if rows is not None else data, put)  # type: ignore[arg-type]
        if self._closed:
            raise RuntimeError("the KV store queue is closed")
        with self._lock:
            for key in job.keys:
                self._inflight[key] = job
        self._queue.put(job)

    def pending(self, key: BlockKey) -> bool:
        return key in self._inflight  # one dict lookup: atomic under the GIL

    def wait_for(self, key: BlockKey) -> None:
        job = self._inflight.get(key)
        if job is not None:
            job.done.wait()

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._worker.join()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            try:
                if job.rows is not None:
                    job.rows.wait()
                    job.payloads = job.rows.payloads()
                assert job.payloads is not None  # a job carries payloads or rows that give them
                job.put(job.keys, job.payloads)
            except Exception:  # a failed store is a later miss; the worker must survive it
                logger.exception("KV offload: storing %d blocks failed", len(job.keys))
            finally:
                with self._lock:
                    for key in job.keys:
                        if self._inflight.get(key) is job:
                            del self._inflight[key]
                job.done.set()
                job.payloads = job.rows = None  # let pinned staging go back to its allocator
                self._queue.task_done()
