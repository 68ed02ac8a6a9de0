"""Local disk tier: one file per block (disk_io.py), written in the background, LRU under a
byte budget; a file failing a check is a counted miss and removed. Processes may share the
directory: files are published by atomic rename of a unique temp file (one key, same bytes), and
each process enforces the budget over the files it knows. No fsync: a torn file fails its crc."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.kv.offload.base import BlockKey, StatsCounter, Tier
from specserve.kv.offload.disk_io import BadEntry, DiskWriter, body_offset, read_entry, write_entry
from specserve.kv.offload.payload import BlockLayout, BlockPayload, PackedPayload, pack

logger = logging.getLogger(__name__)

_MAX_KEY_NAME = 100  # longer keys are named by their blake2b digest
DEFAULT_WRITERS = max(1, min(4, (os.cpu_count() or 1) // 4))
# Reads overlap (syscalls and crc32 release the GIL); more threads than cores only add GIL hand-offs.
DEFAULT_READERS = max(1, min(16, os.cpu_count() or 1))

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0  # temp files older than this belong to a writer that died


class DiskIndex:
    """File name -> size, least recently used first, under `capacity` bytes. Thread-safe. Recency
    survives restarts as file mtimes, stamped strictly increasing within a process."""

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


def file_name(key: BlockKey) -> str:
    if len(key) > _MAX_KEY_NAME:
        return hashlib.blake2b(key, digest_size=32).hexdigest() + SUFFIX
    return key.hex() + SUFFIX


class DiskTier(Tier):
    """Block files under `path`, at most `capacity_bytes` of them, LRU. `put` copies the block and
    queues it (dropped over `max_pending_bytes` queued); queued blocks are served too."""

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        namespace: str,
        max_pending_bytes: int = 256 << 20,
        readers: int = DEFAULT_READERS,
        writers: int = DEFAULT_WRITERS,
    ) -> None:
        super().__init__(capacity_bytes)
        self.path = os.fspath(path)
        self.namespace = namespace
        os.makedirs(self.path, exist_ok=True)
        self._closed = False
        self._index = DiskIndex(self.path, self._capacity, self._stats)
        self._index.rescan()
        # Threads start on demand; the calling thread reads too.
        self._num_readers = max(1, readers)
        self._readers = ThreadPoolExecutor(self._num_readers, thread_name_prefix="specserve-disk-read")
        self._writer = DiskWriter(self._write, max_pending_bytes, writers, self._stats)

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def contains(self, key: BlockKey) -> bool:
        if self.knows(key):
            return True
        try:  # another process may have written it
            size = os.stat(os.path.join(self.path, file_name(key))).st_size
        except OSError:
            return False
        self._index.remember([(file_name(key), size)])
        return True

    def knows(self, key: BlockKey) -> bool:
        """`contains` without a stat: what this process has seen."""
        return key in self._writer or file_name(key) in self._index

    def count_miss(self) -> None:
        self._stats.add(queries=1)

    def get(self, key: BlockKey) -> PackedPayload | None:
        """One block of any layout."""
        return self._get([key], None)[0]

    def get_many(self, keys: list[BlockKey], layout: BlockLayout) -> list[PackedPayload | None]:
        """`get` of every key, read in parallel (other layouts miss) into rows of one buffer
        [len(keys), layout.nbytes], pinned under CUDA."""
        rows = torch.empty((len(keys), layout.nbytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._get(keys, layout, rows)

    def _get(
        self, keys: list[BlockKey], layout: BlockLayout | None, rows: torch.Tensor | None = None
    ) -> list[PackedPayload | None]:
        found = self._writer.copy_pending(keys, layout, rows)
        todo = [i for i, p in enumerate(found) if p is None]
        names = [file_name(key) for key in keys]
        counter = itertools.count()  # next() is atomic under the GIL: a slow file holds up no other

        def work() -> None:
            while (j := next(counter)) < len(todo):
                i = todo[j]
                out = None if rows is None else rows[i]
                read = functools.partial(read_entry, key=keys[i], namespace=self.namespace, layout=layout, out=out)
                found[i] = self._open_and_read(names[i], read)

        futures = [self._readers.submit(work) for _ in range(min(self._num_readers, len(todo)) - 1)]
        try:
            work()  # the calling thread reads too
        finally:
            for fut in futures:
                fut.result()
        read_ok = [(i, p) for i in todo if (p := found[i]) is not None]
        if read_ok:  # recency in key order (the threads finish in any order); mtimes off the caller's path
            self._index.remember((names[i], _file_size(keys[i], p)) for i, p in read_ok)
            paths = [f"{self.path}/{names[i]}" for i, _ in read_ok]
            self._readers.submit(set_mtimes, paths, self._index.stamps(len(read_ok)))
        hits = [p for p in found if p is not None]
        self._stats.add(queries=len(keys), hits=len(hits), bytes_out=sum(p.nbytes for p in hits))
        return found

    def _open_and_read(self, name: str, read: Callable[[int], PackedPayload]) -> PackedPayload | None:
        """read(fd) of the open file; None on a miss, a bad file (counted, removed) or an I/O error
        (counted; the file may be fine next time)."""
        path = f"{self.path}/{name}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # not there (or gone): a plain miss
            self._index.forget(name)
            return None
        try:
            return read(fd)
        except BadEntry as exc:
            logger.warning("KV disk tier: dropping %s: %s", path, exc)
            self._stats.add(errors=1)
            self._index.forget(name)
            with contextlib.suppress(OSError):
                _remove_if_same(path, os.fstat(fd))
        except OSError as exc:
            logger.warning("KV disk tier: reading %s failed: %s", path, exc)
            self._stats.add(errors=1)
        finally:
            os.close(fd)
        return None

    def put_many(self, keys: list[BlockKey], payloads: Sequence[BlockPayload]) -> None:
        """Queue each block not stored yet (copied: the caller may reuse its buffers at once)."""
        if self._closed:
            raise RuntimeError(f"{self.name} tier is closed")
        todo: list[tuple[BlockKey, PackedPayload]] = []
        dropped = 0
        for key, payload in zip(keys, payloads):
            try:
                packed = pack(payload)  # a copy only for a plain dict of tensors
            except Exception as exc:  # a tensor that cannot be read: count it, never raise
                logger.warning("KV disk tier: cannot store %s: %s", file_name(key), exc)
                self._stats.add(errors=1)
                continue
            if key in self._writer or self._index.refresh(file_name(key)):
                continue  # queued, or stored (same key, same bytes): recency refreshed only
            if packed.nbytes > self._capacity:
                dropped += 1
                continue
            todo.append((key, packed))
        if dropped:
            self._stats.add(dropped=dropped)
        if todo:
            self._writer.submit(todo)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        self._readers.shutdown(wait=True)

    def _write(self, key: BlockKey, payload: PackedPayload) -> None:
        """Store one block as its file (on a writer thread): temp file, stamp, atomic rename."""
        name = file_name(key)
        path = f"{self.path}/{name}"
        with contextlib.suppress(OSError):  # another process stored the same block
            self._index.remember([(name, os.stat(path).st_size)])
            set_mtimes([path], self._index.stamps(1))
            return
        size = _file_size(key, payload)
        if size > self._capacity:
            self._stats.add(dropped=1)
            return
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=self.path)
        try:
            try:
                write_entry(fd, key, payload, self.namespace)
                # Recency for a restart; the rename keeps the mtime.
                stamp = self._index.stamps(1)[0]
                os.utime(fd, ns=(stamp, stamp))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            remove_quietly(tmp)
            raise
        self._stats.add(bytes_in=payload.nbytes)
        self._index.remember([(name, size)])


def _file_size(key: BlockKey, payload: PackedPayload) -> int:
    return body_offset(len(key), len(payload.layout.json)) + payload.nbytes


def _remove_if_same(path: str, st: os.stat_result) -> None:
    """Remove a bad file unless another writer has meanwhile replaced it (OSError: caller's)."""
    now = os.stat(path)
    if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
        os.remove(path)
