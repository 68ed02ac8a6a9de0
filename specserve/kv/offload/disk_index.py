"""The disk tier's view of its directory: block files by recency, their sizes, the byte budget.
Recency survives restarts through file mtimes, stamped strictly increasing within a process."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

from specserve.kv.offload.base import StatsCounter

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0  # temp files older than this belong to a writer that died


class DiskIndex:
    """File name -> size, least recently used first, under `capacity` bytes. Thread-safe."""

    def __init__(self, path: str, capacity: int, stats: StatsCounter) -> None:
        self.path = path
        self.capacity = capacity
        self._stats = stats
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()
        self.used_bytes = 0
        self._last_stamp_ns = 0

    def __contains__(self, name: str) -> bool:
        return name in self._files  # one dict lookup: atomic under the GIL

    def refresh(self, name: str) -> bool:
        """Mark a known file most recently used (in memory only); False if unknown."""
        if name not in self._files:  # no lock in the common case
            return False
        with self._lock:
            if name not in self._files:
                return False
            self._files.move_to_end(name)
            return True

    def rescan(self) -> None:
        """Rebuild from the directory (mtime order), drop dead temp files, evict to the budget."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        with os.scandir(self.path) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if entry.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > _STALE_TMP_SECONDS:
                        remove_quietly(entry.path)
                elif entry.name.endswith(SUFFIX) and entry.is_file():
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        with self._lock:
            self._files = OrderedDict((name, size) for _, name, size in found)
            self.used_bytes = sum(size for _, _, size in found)
            if found:  # later stamps must sort after every file already there
                self._last_stamp_ns = max(self._last_stamp_ns, found[-1][0])
        self.evict()

    def remember(self, entries: Iterable[tuple[str, int]]) -> None:
        """Mark files most recently used, in order (adding unknown ones)."""
        added = None
        with self._lock:
            for name, size in entries:
                old = self._files.pop(name, None)
                self.used_bytes += size - (old or 0)
                self._files[name] = size
                if old is None:
                    added = name
        if added is not None:
            self.evict(keep=added)

    def forget(self, name: str) -> None:
        with self._lock:
            size = self._files.pop(name, None)
            if size is not None:
                self.used_bytes -= size

    def evict(self, keep: str | None = None) -> None:
        """Remove least recently used files until the budget holds (never `keep`, the newest)."""
        victims = []
        with self._lock:
            while self.used_bytes > self.capacity and self._files:
                name, size = next(iter(self._files.items()))
                if name == keep:  # `keep` is the newest entry, so nothing else is left
                    break
                del self._files[name]
                self.used_bytes -= size
                victims.append(name)
        for name in victims:
            remove_quietly(os.path.join(self.path, name))
        if victims:
            self._stats.add(evictions=len(victims))

    def stamps(self, n: int) -> list[int]:
        """n strictly increasing mtimes (ns), later than any given out before."""
        with self._lock:
            first = max(time.time_ns(), self._last_stamp_ns + 1)
            self._last_stamp_ns = first + n - 1
        return list(range(first, first + n))


def set_mtimes(paths: list[str], stamps: list[int]) -> None:
    for path, ns in zip(paths, stamps):
        with contextlib.suppress(OSError):
            os.utime(path, ns=(ns, ns))


def remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
