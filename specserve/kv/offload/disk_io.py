"""The disk tier's file I/O. Its block file (little endian), `<hex of key>.kvb`:
    magic "SKVB" | version u16 | key length u16 | layout length u32 | body length u64 |
    crc32(layout + body) u32 | blake2b-128(namespace) 16 bytes | key bytes | layout JSON |
    zero padding to a multiple of 64 | body (the packed payload buffer, `payload.BlockLayout`).
The layout is JSON, never pickle. A file of another version, namespace or key, of a size other
than the header says, or failing its crc (accidents, not attackers) is rejected (BadEntry).
DiskWriter, the write queue: `submit` copies each block, so the caller's staging is free at once;
until its file is in place a block is served from there (copied out under the lock).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from specserve.kv.offload.base import BlockKey, StatsCounter
from specserve.kv.offload.payload import BlockLayout, BlockPayload, PackedPayload, pack

try:  # ISA-L's crc32: zlib's values, faster (both release the GIL)
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

logger = logging.getLogger(__name__)

MAGIC = b"SKVB"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sHHIQI16s")  # magic, version, key_len, layout_len, body_len, crc32, ns digest
_BODY_ALIGN = 64
_MAX_LAYOUT = 16 << 20  # a layout longer than this is not one of ours


class BadEntry(Exception):
    """A stored file that must not be trusted."""


@functools.lru_cache(maxsize=16)
def namespace_digest(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def body_offset(key_len: int, layout_len: int) -> int:
    return -(-(_HEADER.size + key_len + layout_len) // _BODY_ALIGN) * _BODY_ALIGN


def _as_bytes(t: torch.Tensor) -> memoryview:
    return t.numpy().data.cast("B")


def _prefix(key: bytes, payload: PackedPayload, namespace: str) -> bytes:
    """The file's bytes before the body."""
    if len(key) > 0xFFFF:  # the header's key length is a u16: no file of ours holds it
        raise BadEntry("key too long")
    raw = payload.layout.json
    crc = crc32(_as_bytes(payload.buffer), crc32(raw))
    ns = namespace_digest(namespace)
    prefix = _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), len(raw), payload.nbytes, crc, ns) + key + raw
    return prefix + bytes(body_offset(len(key), len(raw)) - len(prefix))


def encode_entry(key: bytes, payload: BlockPayload, namespace: str) -> bytes:
    payload = pack(payload)
    return _prefix(key, payload, namespace) + _as_bytes(payload.buffer).tobytes()


def write_entry(fd: int, key: bytes, payload: PackedPayload, namespace: str) -> None:
    """Write the file to `fd` (one writev of prefix and body)."""
    parts: list[bytes | memoryview] = [_prefix(key, payload, namespace), _as_bytes(payload.buffer)]
    total = sum(len(p) for p in parts)
    written = os.writev(fd, parts)
    while written < total:  # a short write: finish it plainly
        written += os.write(fd, b"".join(bytes(p) for p in parts)[written:])


def read_entry(
    fd: int, key: bytes, namespace: str, layout: BlockLayout | None = None, out: torch.Tensor | None = None
) -> PackedPayload:
    """Read and check the open file of `key`, its body into `out` ([nbytes] uint8; a new buffer if
    None). `layout`: the only one accepted (None: any). BadEntry (`out` then holds garbage) or OSError."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, _HEADER.size, 0)
    if len(head) < _HEADER.size:
        raise BadEntry("truncated header")
    magic, version, key_len, layout_len, body_len, crc, ns = _HEADER.unpack(head)
    if magic != MAGIC:
        raise BadEntry("bad magic")
    if version != FORMAT_VERSION:
        raise BadEntry(f"format version {version}, expected {FORMAT_VERSION}")
    if ns != namespace_digest(namespace):
        raise BadEntry("written under another namespace")
    if layout_len > _MAX_LAYOUT:
        raise BadEntry("layout too long")
    body_at = body_offset(key_len, layout_len)
    if size != body_at + body_len:
        raise BadEntry(f"file is {size} bytes, header says {body_at + body_len}")
    rest = os.pread(fd, key_len + layout_len, _HEADER.size)
    if rest[:key_len] != key:
        raise BadEntry("stored key differs")
    layout_raw = rest[key_len:]
    if layout is not None and layout_raw != layout.json:
        raise BadEntry("block layout differs from this cache's")
    try:
        found = BlockLayout.from_json(layout_raw)
    except ValueError as exc:
        raise BadEntry(str(exc)) from exc
    if found.nbytes != body_len:
        raise BadEntry(f"layout needs {found.nbytes} bytes, body is {body_len}")
    out = torch.empty(body_len, dtype=torch.uint8) if out is None else out
    body = _as_bytes(out)
    if os.preadv(fd, [body], body_at) != body_len or crc32(body, crc32(layout_raw)) != crc:
        raise BadEntry("checksum mismatch")
    return PackedPayload(out, found)


_BATCH = 8  # blocks per queue item: fewer queue operations per block

WriteBlock = Callable[[BlockKey, PackedPayload], None]


def _copy(payload: PackedPayload, out: torch.Tensor | None = None) -> PackedPayload:
    return pack(payload, out=torch.empty(payload.nbytes, dtype=torch.uint8) if out is None else out)


class DiskWriter:
    """At most `max_pending_bytes` wait; more are dropped. `write(key, payload)` stores one block;
    a failure is counted in `errors`."""

    def __init__(self, write: WriteBlock, max_pending_bytes: int, threads: int, stats: StatsCounter) -> None:
        self._write = write
        self._max_pending = int(max_pending_bytes)
        self._stats = stats
        self._lock = threading.Lock()
        self._pending: dict[BlockKey, PackedPayload] = {}  # complete copies, queued or being written
        self._reserved: set[BlockKey] = set()  # room taken, copy in progress
        self._pending_bytes = 0
        self._jobs: set[Future] = set()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="specserve-disk-writer")

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._pending or key in self._reserved

    def submit(self, items: list[tuple[BlockKey, PackedPayload]]) -> None:
        taken: list[tuple[BlockKey, PackedPayload]] = []
        dropped = 0
        with self._lock:
            for key, src in items:
                if key in self:
                    continue
                if self._pending_bytes + src.nbytes > self._max_pending:
                    dropped += 1
                    continue
                self._reserved.add(key)
                self._pending_bytes += src.nbytes
                taken.append((key, src))
        if dropped:
            self._stats.add(dropped=dropped)
        try:
            copies = [_copy(src) for _, src in taken]
        except BaseException:  # give the room back: nothing of these blocks is queued
            with self._lock:
                for key, src in taken:
                    self._reserved.discard(key)
                    self._pending_bytes -= src.nbytes
            raise
        keys = [key for key, _ in taken]
        with self._lock:
            self._reserved.difference_update(keys)
            self._pending.update(zip(keys, copies))
        for start in range(0, len(keys), _BATCH):
            job = self._pool.submit(self._write_batch, keys[start : start + _BATCH])
            self._jobs.add(job)
            job.add_done_callback(self._jobs.discard)

    def copy_pending(
        self, keys: list[BlockKey], layout: BlockLayout | None, rows: torch.Tensor | None
    ) -> list[PackedPayload | None]:
        """Copies of the queued blocks of `layout` (None: any) among `keys`, into rows
        [len(keys), layout.nbytes] if given."""
        found: list[PackedPayload | None] = [None] * len(keys)
        if not self._pending:
            return found
        with self._lock:
            for i, key in enumerate(keys):
                pending = self._pending.get(key)
                if pending is not None and (layout is None or pending.layout == layout):
                    found[i] = _copy(pending, None if rows is None else rows[i])
        return found

    def flush(self) -> None:
        concurrent.futures.wait(list(self._jobs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _write_batch(self, keys: list[BlockKey]) -> None:
        for key in keys:
            self._write_one(key)

    def _write_one(self, key: BlockKey) -> None:
        payload = self._pending[key]  # published before it was queued; only this thread removes it
        try:
            self._write(key, payload)
        except Exception as exc:  # disk full, permissions, a bad tensor: count, never die
            logger.warning("KV disk tier: write of %s failed: %s", key.hex()[:32], exc)
            self._stats.add(errors=1)
        finally:
            with self._lock:
                del self._pending[key]
                self._pending_bytes -= payload.nbytes
