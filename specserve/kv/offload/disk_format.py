"""The disk tier's block file (little endian), `<hex of key>.kvb`:
    magic "SKVB" | version u16 | key length u16 | layout length u32 | body length u64 |
    crc32(layout + body) u32 | blake2b-128(namespace) 16 bytes | key bytes | layout JSON |
    zero padding to a multiple of 64 | body (the packed payload buffer, `payload.BlockLayout`).
The layout is JSON, never pickle. A file of another version, namespace or key, of a size other
than the header says, or failing its crc (accidents, not attackers) is rejected (BadEntry).
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from typing import NamedTuple

import torch

from specserve.kv.offload.payload import BlockLayout, BlockPayload, PackedPayload, pack

try:  # ISA-L's crc32: zlib's values, faster (both release the GIL)
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

MAGIC = b"SKVB"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sHHIQI16s")  # magic, version, key_len, layout_len, body_len, crc32, ns digest
_BODY_ALIGN = 64
_FIRST_READ = 16 << 10  # header + key + layout of real caches fit (else a second read)
_MAX_LAYOUT = 16 << 20  # a layout longer than this is not one of ours
_CRC_AT = 20  # byte offset of the crc32 field in _HEADER
_CRC_END = _CRC_AT + 4


class BadEntry(Exception):
    """A stored file that must not be trusted."""


@functools.lru_cache(maxsize=16)
def namespace_digest(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def body_offset(key_len: int, layout_len: int) -> int:
    return -(-(_HEADER.size + key_len + layout_len) // _BODY_ALIGN) * _BODY_ALIGN


def _as_bytes(t: torch.Tensor) -> memoryview:
    return t.numpy().data.cast("B")


def _prefix(key: bytes, layout: BlockLayout, crc: int, ns_digest: bytes) -> bytes:
    """The file's bytes before the body."""
    if len(key) > 0xFFFF:  # the header's key length is a u16: no file of ours holds it
        raise BadEntry("key too long")
    raw = layout.json
    prefix = _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), len(raw), layout.nbytes, crc, ns_digest) + key + raw
    return prefix + bytes(body_offset(len(key), len(raw)) - len(prefix))


def encode_prefix(key: bytes, payload: PackedPayload, namespace: str, body: memoryview | None = None) -> bytes:
    """`body`: the payload's bytes, when the caller has them."""
    crc = crc32(_as_bytes(payload.buffer) if body is None else body, crc32(payload.layout.json))
    return _prefix(key, payload.layout, crc, namespace_digest(namespace))


def encode_entry(key: bytes, payload: BlockPayload, namespace: str) -> bytes:
    payload = pack(payload)
    return encode_prefix(key, payload, namespace) + _as_bytes(payload.buffer).tobytes()


def write_entry(fd: int, key: bytes, payload: PackedPayload, namespace: str, body: memoryview | None = None) -> int:
    """Write the file to `fd` (one writev of prefix and body); its size."""
    if body is None:
        body = _as_bytes(payload.buffer)
    parts: list[bytes | memoryview] = [encode_prefix(key, payload, namespace, body), body]
    total = sum(len(p) for p in parts)
    written = os.writev(fd, parts)
    while written < total:  # a short write: finish it plainly
        rest = b"".join(bytes(p) for p in parts)[written:]
        written += os.write(fd, rest)
    return total


class Header(NamedTuple):
    layout: BlockLayout
    layout_raw: bytes
    body_offset: int
    body_len: int
    crc: int


def parse_header(head: bytes, key: bytes, namespace: str, file_size: int, read_more=None) -> Header:
    """Check the file's first bytes `head` (`read_more(n)`: the first n, when `head` is short)."""
    if len(head) < _HEADER.size:
        raise BadEntry("truncated header")
    magic, version, key_len, layout_len, body_len, crc, ns = _HEADER.unpack_from(head)
    if magic != MAGIC:
        raise BadEntry("bad magic")
    if version != FORMAT_VERSION:
        raise BadEntry(f"format version {version}, expected {FORMAT_VERSION}")
    if ns != namespace_digest(namespace):
        raise BadEntry("written under another namespace")
    if layout_len > _MAX_LAYOUT:
        raise BadEntry("layout too long")
    body_at = body_offset(key_len, layout_len)
    if file_size != body_at + body_len:
        raise BadEntry(f"file is {file_size} bytes, header says {body_at + body_len}")
    end = _HEADER.size + key_len + layout_len
    if len(head) < end:
        if read_more is None:
            raise BadEntry("truncated header")
        head = read_more(end)
    if head[_HEADER.size : _HEADER.size + key_len] != key:
        raise BadEntry("stored key differs")
    layout_raw = bytes(head[_HEADER.size + key_len : end])
    try:
        layout = BlockLayout.from_json(layout_raw)
    except ValueError as exc:
        raise BadEntry(str(exc)) from exc
    if layout.nbytes != body_len:
        raise BadEntry(f"layout needs {layout.nbytes} bytes, body is {body_len}")
    return Header(layout, layout_raw, body_at, body_len, crc)


def read_entry(fd: int, key: bytes, namespace: str) -> PackedPayload:
    """Read and check the open file of `key` (any layout); BadEntry or OSError."""
    size = os.fstat(fd).st_size
    header = parse_header(os.pread(fd, min(size, _FIRST_READ), 0), key, namespace, size, lambda n: os.pread(fd, n, 0))
    out = torch.empty(header.body_len, dtype=torch.uint8)
    LayoutReader(namespace, header.layout).read_into(fd, key, _as_bytes(out))
    return PackedPayload(out, header.layout)


class LayoutReader:
    """Reads files of one `layout`: one preadv per file, the body straight into the caller's buffer.
    All before the body but the crc is known in advance, so a good file costs two byte comparisons
    (reader threads share the GIL); only a differing file is parsed. Another layout is BadEntry."""

    def __init__(self, namespace: str, layout: BlockLayout) -> None:
        self.namespace = namespace
        self.layout = layout
        self._ns = namespace_digest(namespace)
        self._layout_crc = crc32(layout.json)  # the crc covers layout + body

    def expected_prefix(self, key: bytes) -> bytes:
        """The prefix of a good file, its crc field zero."""
        return _prefix(key, self.layout, 0, self._ns)

    def read_into(self, fd: int, key: bytes, out: memoryview) -> int:
        """Read and check the file of `key`, its body into `out` ([layout.nbytes]); len(out).
        BadEntry (then `out` holds garbage) or OSError."""
        expected = self.expected_prefix(key)
        prefix = bytearray(len(expected))
        probe = bytearray(1)  # one byte past the end: catches a file longer than the header says
        got = os.preadv(fd, [prefix, out, probe], 0)
        if (
            got == len(expected) + len(out)
            and prefix[:_CRC_AT] == expected[:_CRC_AT]
            and prefix[_CRC_END:] == expected[_CRC_END:]
        ):
            crc = int.from_bytes(prefix[_CRC_AT:_CRC_END], "little")
        else:  # something differs: the full parse says what (or accepts other padding)
            header = parse_header(bytes(prefix[: min(got, len(prefix))]), key, self.namespace, got)
            if header.layout_raw != self.layout.json:
                raise BadEntry("block layout differs from this cache's")
            crc = header.crc
        if crc32(out, self._layout_crc) != crc:
            raise BadEntry("checksum mismatch")
        return len(out)
