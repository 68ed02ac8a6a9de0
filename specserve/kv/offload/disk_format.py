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
several GB/s and releases the GIL, so reads checked on several threads overlap.

Reading is two `pread`s: the header region, then the body straight into the caller's buffer
(a pinned staging row when the block is bound for the GPU); no intermediate bytes objects.
"""
from __future__ import annotations

import hashlib
import os
import struct
import zlib

import torch

from specserve.kv.offload.payload import BlockLayout, BlockPayload, PackedPayload, pack

MAGIC = b"SKVB"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sHHIQI16s")  # magic, version, key_len, layout_len, body_len, crc32, ns digest
_BODY_ALIGN = 64
_FIRST_READ = 16 << 10  # header + key + layout of real caches fit (else a second read)
_MAX_LAYOUT = 16 << 20  # a layout longer than this is not one of ours


class BadEntry(Exception):
    """A stored file that must not be trusted."""


def namespace_digest(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def body_offset(key_len: int, layout_len: int) -> int:
    return -(-(_HEADER.size + key_len + layout_len) // _BODY_ALIGN) * _BODY_ALIGN


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU uint8 tensor."""
    return memoryview(t.numpy()).cast("B")


def encode_prefix(key: bytes, payload: PackedPayload, namespace: str, body: memoryview | None = None) -> bytes:
    """Everything of the file before the body (header, key, layout, padding); `body` is the
    payload's bytes when the caller has them already."""
    layout = payload.layout.json
    crc = zlib.crc32(_as_bytes(payload.buffer) if body is None else body, zlib.crc32(layout))
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), len(layout), payload.nbytes, crc,
                          namespace_digest(namespace))
    prefix = header + key + layout
    return prefix + bytes(body_offset(len(key), len(layout)) - len(prefix))


def encode_entry(key: bytes, payload: BlockPayload, namespace: str) -> bytes:
    """The whole file as bytes (tests, small tools; the writer uses `write_entry`)."""
    payload = pack(payload)
    return encode_prefix(key, payload, namespace) + _as_bytes(payload.buffer).tobytes()


def write_entry(fd: int, key: bytes, payload: PackedPayload, namespace: str) -> int:
    """Write the file to `fd` (one writev of prefix and body); its size."""
    body = _as_bytes(payload.buffer)
    parts = [encode_prefix(key, payload, namespace, body), body]
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


def parse_header(head: bytes, key: bytes, namespace: str, file_size: int,
                 read_more=None) -> Header:
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
    if head[_HEADER.size:_HEADER.size + key_len] != key:
        raise BadEntry("stored key differs")
    layout_raw = bytes(head[_HEADER.size + key_len:end])
    try:
        layout = BlockLayout.from_json(layout_raw)
    except ValueError as exc:
        raise BadEntry(str(exc)) from exc
    if layout.nbytes != body_len:
        raise BadEntry(f"layout needs {layout.nbytes} bytes, body is {body_len}")
    return Header(layout, layout_raw, body_at, body_len, crc)


def check_body(header: Header, body: torch.Tensor | memoryview) -> None:
    data = _as_bytes(body) if isinstance(body, torch.Tensor) else body
    if zlib.crc32(data, zlib.crc32(header.layout_raw)) != header.crc:
        raise BadEntry("checksum mismatch")


def decode_entry(key: bytes, blob: bytes, namespace: str) -> PackedPayload:
    """The payload of a whole file held in memory; BadEntry says why it cannot be trusted."""
    header = parse_header(blob, key, namespace, len(blob))
    body = torch.frombuffer(bytearray(blob[header.body_offset:]), dtype=torch.uint8) if header.body_len else \
        torch.empty(0, dtype=torch.uint8)
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


def read_entry_as(fd: int, key: bytes, namespace: str, layout: BlockLayout, out: torch.Tensor,
                  out_bytes: memoryview) -> PackedPayload:
    """Read a file expected to hold a block of `layout` with one preadv: header into a small
    buffer, body straight into `out` (`out_bytes` is its memory), plus one byte past the end to
    catch a longer file. A file of another layout is foreign: BadEntry, like a corrupt one."""
    prefix = bytearray(body_offset(len(key), len(layout.json)))
    probe = bytearray(1)
    got = os.preadv(fd, [prefix, out_bytes, probe], 0)
    header = parse_header(bytes(prefix[:min(got, len(prefix))]), key, namespace, got)
    if header.layout_raw != layout.json:
        raise BadEntry("block layout differs from this cache's")
    check_body(header, out_bytes)
    return PackedPayload(out, header.layout)

