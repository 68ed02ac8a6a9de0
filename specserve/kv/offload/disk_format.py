"""The block file of the disk tier: one header, then the packed block bytes as they are in memory.

Layout (little endian), `<hex of key>.kvb`:
    magic "SKVB" | version u16 | key length u16 | layout length u32 | body length u64 |
    crc32(layout + body) u32 | blake2b-128(namespace) 16 bytes | key bytes | layout JSON |
    zero padding to a multiple of 64 | body (the packed payload buffer, `payload.BlockLayout`).
The layout is JSON ([name, dtype, shape, offset] per tensor), never pickle: a hostile file can at
worst be a wrong tensor. Everything needed to reject a file is in the header: another format
version (version 1 held a safetensors body), another namespace (model / KV dtype), a different
key (name collision, renamed file), a file shorter or longer than the header says, a crc that
differs (bit rot, torn write). crc32 guards against accidents, not attackers; zlib's runs at
~2 GB/s a core, ISA-L's (the `isal` package, used when installed) at ~13, and both release the
GIL, so reads checked on several threads overlap.

Reading a block of a known layout (`LayoutReader`, a prefix hit) is one `preadv`: the header
region into a small buffer, the body straight into the caller's buffer (a pinned staging row when
the block is bound for the GPU); no intermediate bytes objects. Without a layout, `read_entry`
reads the header region, then the body.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct

import torch

from specserve.kv.offload.payload import BlockLayout, BlockPayload, PackedPayload, pack

try:  # ISA-L's crc32: the same values as zlib's, ~6x faster (SIMD), and it releases the GIL too
    from isal.isal_zlib import crc32
except ImportError:  # optional: zlib's is the reference
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


@functools.lru_cache(maxsize=16)  # once per tier, not once per block written or read
def namespace_digest(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def body_offset(key_len: int, layout_len: int) -> int:
    return -(-(_HEADER.size + key_len + layout_len) // _BODY_ALIGN) * _BODY_ALIGN


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU uint8 tensor."""
    return t.numpy().data.cast("B")


def encode_prefix(key: bytes, payload: PackedPayload, namespace: str, body: memoryview | None = None) -> bytes:
    """Everything of the file before the body (header, key, layout, padding); `body` is the
    payload's bytes when the caller has them already."""
    layout = payload.layout.json
    crc = crc32(_as_bytes(payload.buffer) if body is None else body, crc32(layout))
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, len(key), len(layout), payload.nbytes, crc, namespace_digest(namespace)
    )
    prefix = header + key + layout
    return prefix + bytes(body_offset(len(key), len(layout)) - len(prefix))


def encode_entry(key: bytes, payload: BlockPayload, namespace: str) -> bytes:
    """The whole file as bytes (tests, small tools; the writer uses `write_entry`)."""
    payload = pack(payload)
    return encode_prefix(key, payload, namespace) + _as_bytes(payload.buffer).tobytes()


def write_entry(fd: int, key: bytes, payload: PackedPayload, namespace: str, body: memoryview | None = None) -> int:
    """Write the file to `fd` (one writev of prefix and body); its size. `body`: the payload's
    bytes, when the caller has them as a memoryview already."""
    if body is None:
        body = _as_bytes(payload.buffer)
    parts: list[bytes | memoryview] = [encode_prefix(key, payload, namespace, body), body]
    total = sum(len(p) for p in parts)
    written = os.writev(fd, parts)
    while written < total:  # a short write (rare: signals, some file systems): finish it plainly
        rest = b"".join(bytes(p) for p in parts)[written:]
        written += os.write(fd, rest)
    return total


class Header:
    """The parsed, checked header of one file: where the body is and what it should hash to."""

    __slots__ = ("body_len", "body_offset", "crc", "layout", "layout_raw")

    def __init__(self, layout: BlockLayout, layout_raw: bytes, body_offset: int, body_len: int, crc: int) -> None:
        self.layout, self.layout_raw = layout, layout_raw
        self.body_offset, self.body_len, self.crc = body_offset, body_len, crc


def parse_header(head: bytes, key: bytes, namespace: str, file_size: int, read_more=None) -> Header:
    """Check the header region `head` (the file's first bytes; `read_more(n)` returns the first n
    when `head` is too short). BadEntry says why the file cannot be trusted."""
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


def check_body(header: Header, body: torch.Tensor | memoryview) -> None:
    data = _as_bytes(body) if isinstance(body, torch.Tensor) else body
    if crc32(data, crc32(header.layout_raw)) != header.crc:
        raise BadEntry("checksum mismatch")


def decode_entry(key: bytes, blob: bytes, namespace: str) -> PackedPayload:
    """The payload of a whole file held in memory; BadEntry says why it cannot be trusted."""
    header = parse_header(blob, key, namespace, len(blob))
    body = (
        torch.frombuffer(bytearray(blob[header.body_offset :]), dtype=torch.uint8)
        if header.body_len
        else torch.empty(0, dtype=torch.uint8)
    )
    check_body(header, body)
    return PackedPayload(body, header.layout)


def read_entry(fd: int, key: bytes, namespace: str, out: torch.Tensor | None = None) -> PackedPayload:
    """Read and check the open file `fd` of `key`: the body lands in `out` ([nbytes] uint8, CPU)
    when it has the right size, else in a fresh buffer. BadEntry if it cannot be trusted;
    OSError on I/O trouble."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, min(size, _FIRST_READ), 0)
    header = parse_header(head, key, namespace, size, read_more=lambda n: os.pread(fd, n, 0))
    if out is None or out.numel() != header.body_len:
        out = torch.empty(header.body_len, dtype=torch.uint8)
    if header.body_len:
        got = os.preadv(fd, [_as_bytes(out)], header.body_offset)
        if got != header.body_len:
            raise BadEntry(f"body is {got} bytes, header says {header.body_len}")
    check_body(header, out)
    return PackedPayload(out, header.layout)


class LayoutReader:
    """Reads files expected to hold blocks of one `layout` under one `namespace` (a prefix hit of
    this engine's caches): one preadv per file, the body straight into the caller's buffer.

    Everything in the file before the body is known in advance except the crc, so the common
    case is checked with two byte comparisons against the expected prefix; only a file that
    differs is parsed (`parse_header`), to say why it is bad, or to accept one that differs only
    in its padding. Little Python runs per file: on a prefix hit the reader threads share the
    GIL, and the time each holds it is what serializes them.
    A file of another layout is foreign: BadEntry, like a corrupt one.
    """

    def __init__(self, namespace: str, layout: BlockLayout) -> None:
        self.namespace = namespace
        self.layout = layout
        self._ns = namespace_digest(namespace)
        self._layout_crc = crc32(layout.json)  # the crc covers layout + body: start from it
        self._parts: dict[int, tuple[bytes, bytes]] = {}  # key length -> (header, layout + padding)

    def expected_prefix(self, key: bytes) -> bytes:
        """The file's bytes before the body, its crc field zero."""
        parts = self._parts.get(len(key))
        if parts is None:  # once per key length: only the key differs from file to file
            layout = self.layout.json
            if len(key) > 0xFFFF:  # the header's key length is a u16: no file of ours holds it
                raise BadEntry("key too long")
            header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), len(layout), self.layout.nbytes, 0, self._ns)
            pad = body_offset(len(key), len(layout)) - len(header) - len(key) - len(layout)
            parts = self._parts[len(key)] = (header, layout + bytes(pad))
        return parts[0] + key + parts[1]

    def read_into(self, fd: int, key: bytes, out: memoryview) -> None:
        """Read and check the open file `fd` of `key`, its body into `out` ([layout.nbytes] bytes).
        BadEntry if it cannot be trusted (`out` then holds garbage); OSError on I/O trouble."""
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
        if crc32(out, self._layout_crc) != crc:  # releases the GIL: readers check in parallel
            raise BadEntry("checksum mismatch")
