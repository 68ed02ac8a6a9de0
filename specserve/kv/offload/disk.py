"""Local disk tier: one file per block, written in the background, LRU under a byte budget.

File layout (little endian), `<hex of key>.kvb`:
    magic "SKVB" | version u16 | key length u16 | body length u64 | crc32(body) u32 |
    blake2b-128(namespace) 16 bytes | key bytes | body = safetensors bytes of the payload.
Everything a reader needs to reject an entry is in the header: another format version, another
namespace (model / KV dtype), a different key (name collision or a renamed file), a short or
long body (truncated / appended), a body whose crc32 differs (bit rot, torn write). Such an entry
is a miss, counted in `stats.errors`, and its file is removed. crc32 guards against accidents,
not attackers; safetensors (never pickle) means a hostile file can at worst be a wrong tensor.

Sharing a directory: writes go to a unique temp file in the same directory and are published
with `os.replace`, which is atomic, so readers in any process see a whole file or none; two
writers of one key write the same bytes (keys are content addresses), so the last rename wins
harmlessly. Each process enforces the byte budget over the files it knows (those found at
startup plus those it wrote or read since), so N processes may together exceed it by what the
others wrote since this one started; `rescan()` refreshes the view.

Recency survives restarts through file mtimes: a hit touches its file, the startup scan orders
files by mtime. Durability: no fsync; after a power loss a torn file fails its crc and is a miss.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from specserve.kv.offload.base import BlockKey, BlockPayload, StatsCounter, TierStats, payload_nbytes

logger = logging.getLogger(__name__)

MAGIC = b"SKVB"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
_HEADER = struct.Struct("<4sHHQI16s")  # magic, version, key_len, body_len, crc32, namespace digest
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0  # temp files older than this belong to a writer that died
_MAX_KEY_NAME = 100  # longer keys are named by their blake2b digest (file names stay short)


class _BadEntry(Exception):
    """A stored file that must not be trusted."""


def _namespace_digest(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def file_name(key: BlockKey) -> str:
    """The file of `key` (hex of the key; of its digest when the key is long)."""
    if len(key) > _MAX_KEY_NAME:
        return hashlib.blake2b(key, digest_size=32).hexdigest() + SUFFIX
    return key.hex() + SUFFIX


def encode_entry(key: BlockKey, payload: BlockPayload, namespace: str) -> bytes:
    """Header + safetensors body of one block file."""
    body = st_save({name: t.detach().cpu().contiguous() for name, t in payload.items()})
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), len(body), zlib.crc32(body),
                          _namespace_digest(namespace))
    return header + key + body


def decode_entry(key: BlockKey, blob: bytes, namespace: str) -> BlockPayload:
    """The payload of a block file; _BadEntry says why the file cannot be trusted."""
    if len(blob) < _HEADER.size:
        raise _BadEntry("truncated header")
    magic, version, key_len, body_len, crc, ns = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise _BadEntry("bad magic")
    if version != FORMAT_VERSION:
        raise _BadEntry(f"format version {version}, expected {FORMAT_VERSION}")
    if ns != _namespace_digest(namespace):
        raise _BadEntry("written under another namespace")
    body_start = _HEADER.size + key_len
    if blob[_HEADER.size:body_start] != key:
        raise _BadEntry("stored key differs")
    body = memoryview(blob)[body_start:]
    if len(body) != body_len:
        raise _BadEntry(f"body is {len(body)} bytes, header says {body_len}")
    if zlib.crc32(body) != crc:
        raise _BadEntry("checksum mismatch")
    try:
        return st_load(bytes(body))
    except Exception as exc:  # a body that passed the crc but is not safetensors: foreign writer
        raise _BadEntry(f"unreadable body: {exc}") from exc


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
        self._pending: dict[BlockKey, tuple[BlockPayload, int]] = {}
        self._pending_bytes = 0
        self._last_touch_ns = 0
        self._stats = StatsCounter()
        self._closed = False
        self._queue: queue.Queue[tuple[BlockKey, BlockPayload, int] | None] = queue.Queue()
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

    def get(self, key: BlockKey) -> BlockPayload | None:
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            self._stats.add(queries=1, hits=1, bytes_out=pending[1])
            return pending[0]
        self._stats.add(queries=1)
        name = file_name(key)
        path = os.path.join(self.path, name)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                blob = f.read()
        except OSError:  # not there (or gone): a plain miss
            self._forget(name)
            return None
        try:
            payload = decode_entry(key, blob, self.namespace)
        except _BadEntry as exc:
            logger.warning("KV disk tier: dropping %s: %s", path, exc)
            self._stats.add(errors=1)
            self._forget(name)
            _remove_if_same(path, st)
            return None
        self._touch(path)
        self._remember(name, len(blob))
        self._stats.add(hits=1, bytes_out=payload_nbytes(payload))
        return payload

    def put(self, key: BlockKey, payload: BlockPayload) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} tier is closed")
        size = payload_nbytes(payload)
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
            self._pending[key] = (payload, size)
            self._pending_bytes += size
        self._queue.put((key, payload, size))

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()

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
        # Strictly increasing mtimes within a process keep the on-disk order equal to the
        # in-memory order even on coarse clocks (so a restart sees the same LRU).
        with self._lock:
            now = max(time.time_ns(), self._last_touch_ns + 1)
            self._last_touch_ns = now
        try:
            os.utime(path, ns=(now, now))
        except OSError:
            pass

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

    def _write(self, key: BlockKey, payload: BlockPayload) -> None:
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
        blob = encode_entry(key, payload, self.namespace)
        if len(blob) > self._capacity:
            self._stats.add(dropped=1)
            return
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=_TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            _remove_quietly(tmp)
            raise
        self._touch(path)
        self._stats.add(bytes_in=payload_nbytes(payload))
        self._remember(name, len(blob))


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
