"""Many small reads at once (the disk tier's loads): syscalls and crc32 release the GIL, so threads
overlap. Threads take the next file from a shared counter; the calling thread reads too."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

# More threads than cores only add GIL hand-offs.
DEFAULT_THREADS = max(1, min(16, os.cpu_count() or 1))


class ParallelReads:
    """A lazily started pool, plus the caller's thread."""

    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="specserve-disk-read")
            return self._pool

    def run(self, n: int, read_one: Callable[[int], None]) -> None:
        """read_one(i) for every i in range(n) on up to `threads` threads (its first exception is re-raised)."""
        counter = itertools.count()  # next() on it is atomic under the GIL

        def work() -> None:
            while (i := next(counter)) < n:
                read_one(i)

        helpers = min(self.threads, n) - 1
        futures = [self._executor().submit(work) for _ in range(helpers)] if helpers > 0 else []
        try:
            work()
        finally:
            for fut in futures:
                fut.result()

    def submit(self, fn: Callable[..., object], *args: object) -> Future:
        return self._executor().submit(fn, *args)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
