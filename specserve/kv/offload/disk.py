"""Local disk tier: one file per block, written in the background, LRU under a byte budget.

The file format (header, checksum, namespace, format version) is in disk_format.py. An entry
that fails any check there is a miss, counted in `stats.errors`, and its file is removed.

Sharing a directory: writes go to a unique temp file in the same directory and are published
with `os.replace`, which is atomic, so readers in any process see a whole file or none; two
writers of one key write the same bytes (keys are content addresses), so the last rename wins
harmlessly. Each process enforces the byte budget over the files it knows (those found at
startup plus those it wrote or read since), so N processes may together exceed it by what the
others wrote since this one started; `rescan()` refreshes the view.

Recency survives restarts through file mtimes: a hit touches its file, the startup scan orders
files by mtime. Durability: no fsync; after a power loss a torn file fails its crc and is a miss.

Reads of many blocks (`get_many`, a prefix hit) run on a small thread pool, each file read
straight into its row of one (pinned, when CUDA is present) buffer: open, pread and crc32
release the GIL, so files are read and checked in parallel and the rows go to the GPU in one copy.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.kv.offload.base import BlockKey, StatsCounter, TierStats
from specserve.kv.offload.disk_format import BadEntry, body_offset, encode_entry, read_entry, read_entry_as, write_entry
from specserve.kv.offload.payload import BlockLayout, BlockPayload, PackedPayload, pack

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0  # temp files older than this belong to a writer that died
_MAX_KEY_NAME = 100  # longer keys are named by their blake2b digest (file names stay short)
_READERS = max(1, min(16, os.cpu_count() or 1))  # syscalls and crc32 release the GIL

__all__ = ["SUFFIX", "DiskTier", "encode_entry", "file_name"]


def file_name(key: BlockKey) -> str:
    """The file of `key` (hex of the key; of its digest when the key is long)."""
    if len(key) > _MAX_KEY_NAME:
        return hashlib.blake2b(key, digest_size=32).hexdigest() + SUFFIX
    return key.hex() + SUFFIX


class DiskTier:
    """Block files under `path`, at most `capacity_bytes` of them (file sizes), LRU.

    `put` only enqueues (a writer thread serializes and writes); when more than
    `max_pending_bytes` of payloads wait, `put` drops the block rather than block the caller.
    Until written, a block is served from the queue.
    """

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, namespace: str,
                 max_pending_bytes: int = 256 << 20, name: str = "disk") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.path = os.fspath(path)
        self.namespace = namespace
        os.makedirs(self.path, exist_ok=True)
        self._capacity = int(capacity_bytes)
        self._max_pending = int(max_pending_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> size, oldest first
        self._used = 0
        self._pending: dict[BlockKey, tuple[PackedPayload, int]] = {}
        self._pending_bytes = 0
        self._last_touch_ns = 0
        self._stats = StatsCounter()
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None  # get_many's readers, started on first use
        self._queue: queue.Queue[tuple[BlockKey, PackedPayload, int] | None] = queue.Queue()
        self.rescan()
        self._writer = threading.Thread(target=self._writer_loop, name=f"specserve-{name}-writer",
                                        daemon=True)
        self._writer.start()

    # -- OffloadTier -------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def stats(self) -> TierStats:
        return self._stats.snapshot()

    def contains(self, key: BlockKey) -> bool:
        name = file_name(key)
        with self._lock:
            if key in self._pending or name in self._index:
                return True
        try:  # another process may have written it
            size = os.stat(os.path.join(self.path, name)).st_size
        except OSError:
            return False
        self._remember(name, size)
        return True

    def knows(self, key: BlockKey) -> bool:
        """`contains` without asking the file system (no stat): what this process has seen."""
        with self._lock:
            return key in self._pending or file_name(key) in self._index

    def get(self, key: BlockKey) -> PackedPayload | None:
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            self._stats.add(queries=1, hits=1, bytes_out=pending[1])
            return pending[0]
        self._stats.add(queries=1)
        payload = self._read(key)
        if payload is not None:
            self._stats.add(hits=1, bytes_out=payload.nbytes)
        return payload

    def get_many(self, keys: list[BlockKey], layout: BlockLayout | None = None) -> list[PackedPayload | None]:
        """`get` of every key, files read in parallel. With `layout` (what the caller can use;
        a file of another layout is then a counted miss), each body lands in its row of one
        buffer [len(keys), layout.nbytes], pinned when CUDA is present, so consecutive hits are
        adjacent in memory (one host->device copy), and each file is one read."""
        if not keys:
            return []
        out: list[PackedPayload | None] = [None] * len(keys)
        sizes: list[int | None] = [None] * len(keys)
        expect: list = [None] * len(keys)
        if layout is not None:
            rows = torch.empty((len(keys), layout.nbytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            flat = memoryview(rows.view(-1).numpy()).cast("B")  # one conversion, sliced per row
            n = layout.nbytes
            expect = [(layout, row, flat[i * n:(i + 1) * n]) for i, row in enumerate(rows.unbind(0))]

        def read(indices: list[int]) -> None:
            for i in indices:
                got = self._read_file(keys[i], expect[i])
                if got is not None:
                    out[i], sizes[i] = got

        with self._lock:
            pending = [self._pending.get(key) for key in keys]
        todo = [i for i, p in enumerate(pending) if p is None]
        for i, p in enumerate(pending):
            if p is not None:
                out[i] = p[0]
        if len(todo) > 1 and _READERS > 1:
            step = -(-len(todo) // _READERS)  # contiguous spans: each reader walks its files in order
            for fut in [self._readers().submit(read, todo[j:j + step]) for j in range(0, len(todo), step)]:
                fut.result()
        else:
            read(todo)
        touched = [i for i in todo if sizes[i] is not None]
        for i in touched:  # recency in key order (the threads finish in any order)
            self._remember(file_name(keys[i]), sizes[i])
        if touched:  # mtimes (recency after a restart) are set off the caller's path
            paths = [os.path.join(self.path, file_name(keys[i])) for i in touched]
            self._readers().submit(_set_mtimes, paths, self._stamps(len(paths)))
        hits = [p for p in out if p is not None]
        self._stats.add(queries=len(keys), hits=len(hits), bytes_out=sum(p.nbytes for p in hits))
        return out

    def _read(self, key: BlockKey) -> PackedPayload | None:
        """One file, marked most recently used (None on a miss or a bad file)."""
        got = self._read_file(key)
        if got is None:
            return None
        if got[1] is not None:
            self._touch(os.path.join(self.path, file_name(key)))
            self._remember(file_name(key), got[1])
        return got[0]

    def _read_file(self, key: BlockKey, expect: tuple[BlockLayout, torch.Tensor, memoryview] | None = None
                   ) -> tuple[PackedPayload, int | None] | None:
        """(payload, file size; None if served from the write queue), or None on a miss or a bad
        file (counted and removed). `expect`: (layout, destination, its memory) for one-read
        files of a known layout."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:  # queued since the caller looked: serve it from memory
            return pending[0], None
        name = file_name(key)
        path = os.path.join(self.path, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # not there (or gone): a plain miss
            self._forget(name)
            return None
        try:
            if expect is None:
                payload = read_entry(fd, key, self.namespace)
            else:
                payload = read_entry_as(fd, key, self.namespace, *expect)
        except BadEntry as exc:
            logger.warning("KV disk tier: dropping %s: %s", path, exc)
            self._stats.add(errors=1)
            self._forget(name)
            with contextlib.suppress(OSError):
                _remove_if_same(path, os.fstat(fd))
            return None
        except OSError as exc:  # an I/O error: a miss, the file may be fine next time
            logger.warning("KV disk tier: reading %s failed: %s", path, exc)
            self._stats.add(errors=1)
            return None
        finally:
            os.close(fd)
        return payload, _file_size(key, payload)

    def _readers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix=f"specserve-{self.name}-read")
            return self._pool

    def put(self, key: BlockKey, payload: BlockPayload) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} tier is closed")
        try:
            packed = pack(payload)  # a copy only for a plain dict of tensors
        except Exception as exc:  # a tensor that cannot be read: count it, never raise
            logger.warning("KV disk tier: cannot store %s: %s", file_name(key), exc)
            self._stats.add(errors=1)
            return
        size = packed.nbytes
        name = file_name(key)
        with self._lock:
            if key in self._pending:
                return
            if name in self._index:  # already stored: same key, same bytes; refresh recency only
                self._index.move_to_end(name)
                return
            if size > self._capacity or self._pending_bytes + size > self._max_pending:
                self._stats.add(dropped=1)
                return
            self._pending[key] = (packed, size)
            self._pending_bytes += size
        self._queue.put((key, packed, size))

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- bookkeeping -------------------------------------------------------------------------

    def rescan(self) -> None:
        """Rebuild the LRU index from the directory (mtime order), drop dead temp files, and
        evict down to the budget."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        with os.scandir(self.path) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if entry.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > _STALE_TMP_SECONDS:
                        _remove_quietly(entry.path)
                elif entry.name.endswith(SUFFIX) and entry.is_file():
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((name, size) for _, name, size in found)
            self._used = sum(size for _, _, size in found)
            if found:  # later touches must sort after every file already there
                self._last_touch_ns = max(self._last_touch_ns, found[-1][0])
        self._evict()

    def _remember(self, name: str, size: int) -> None:
        """Mark `name` most recently used (adding it if another process wrote it)."""
        with self._lock:
            old = self._index.pop(name, None)
            self._used += size - (old or 0)
            self._index[name] = size
        if old is None:
            self._evict(keep=name)

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size

    def _evict(self, keep: str | None = None) -> None:
        """Remove least recently used files until the budget holds (never `keep`)."""
        victims = []
        with self._lock:
            while self._used > self._capacity and self._index:
                name, size = next(iter(self._index.items()))
                if name == keep:  # `keep` is the newest entry, so nothing else is left
                    break
                del self._index[name]
                self._used -= size
                victims.append(name)
        for name in victims:
            _remove_quietly(os.path.join(self.path, name))
        if victims:
            self._stats.add(evictions=len(victims))

    def _touch(self, path: str) -> None:
        _set_mtime(path, self._stamps(1)[0])

    def _stamps(self, n: int) -> list[int]:
        # Strictly increasing mtimes within a process keep the on-disk order equal to the
        # in-memory order even on coarse clocks (so a restart sees the same LRU).
        with self._lock:
            first = max(time.time_ns(), self._last_touch_ns + 1)
            self._last_touch_ns = first + n - 1
        return list(range(first, first + n))

    # -- writer thread -----------------------------------------------------------------------

    def _writer_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, payload, size = item
            try:
                self._write(key, payload)
            except Exception as exc:  # disk full, permissions, a bad tensor: count, never die
                logger.warning("KV disk tier: write of %s failed: %s", file_name(key), exc)
                self._stats.add(errors=1)
            finally:
                # Only now: until the file is in place, get() must find the block here.
                with self._lock:
                    self._pending.pop(key, None)
                    self._pending_bytes -= size
                self._queue.task_done()

    def _write(self, key: BlockKey, payload: PackedPayload) -> None:
        name = file_name(key)
        path = os.path.join(self.path, name)
        try:
            existing = os.path.getsize(path)
        except OSError:
            existing = None
        if existing is not None:  # another process stored the same block
            self._touch(path)
            self._remember(name, existing)
            return
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=_TMP_PREFIX)
        try:
            try:
                size = write_entry(fd, key, payload, self.namespace)
            finally:
                os.close(fd)
            if size > self._capacity:
                _remove_quietly(tmp)
                self._stats.add(dropped=1)
                return
            os.replace(tmp, path)
        except BaseException:
            _remove_quietly(tmp)
            raise
        self._touch(path)
        self._stats.add(bytes_in=payload.nbytes)
        self._remember(name, size)


def _file_size(key: BlockKey, payload: PackedPayload) -> int:
    """Bytes of the file that holds `payload` (it was just read whole, so no fstat needed)."""
    return body_offset(len(key), len(payload.layout.json)) + payload.nbytes


def _set_mtimes(paths: list[str], stamps: list[int]) -> None:
    for path, ns in zip(paths, stamps):
        _set_mtime(path, ns)


def _set_mtime(path: str, ns: int) -> None:
    try:
        os.utime(path, ns=(ns, ns))
    except OSError:
        pass


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _remove_if_same(path: str, st: os.stat_result) -> None:
    """Remove a bad file unless another writer has meanwhile replaced it with a new one."""
    try:
        now = os.stat(path)
        if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
            os.remove(path)
    except OSError:
        pass
