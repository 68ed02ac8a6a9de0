"""Disk tier fast paths: parallel loads of many blocks (byte-identical, bad files are counted misses
that do not stop the others), the file checks, stores that copy (the caller's buffer is
free at once) on several writer threads, and the optional ISA-L crc32."""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from specserve.config import OffloadConfig
from specserve.kv.offload.disk import DiskTier, file_name
from specserve.kv.offload.disk_io import BadEntry, encode_entry, namespace_digest, read_entry
from specserve.kv.offload.offloader import KVOffloader
from specserve.kv.offload.payload import BlockLayout, PackedPayload

NS = "model-x/bf16"
LAYOUT = BlockLayout.of([(f"{i}.{n}", torch.bfloat16, (4, 2, 8)) for i in range(3) for n in ("key", "value")])


def _key(i: int) -> bytes:
    return b"blk" + i.to_bytes(8, "little")


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, LAYOUT.nbytes), dtype=torch.uint8, generator=g)


def _write(path: Path, rows: torch.Tensor, **kw) -> None:
    tier = DiskTier(path, 1 << 30, NS, **kw)
    tier.put_many([_key(i) for i in range(rows.shape[0])], [PackedPayload(r, LAYOUT) for r in rows])
    tier.close()


@pytest.mark.parametrize("readers", [1, 4, 16])
def test_parallel_load_is_byte_identical(tmp_path: Path, readers: int) -> None:
    rows = _rows(64)
    _write(tmp_path, rows, writers=3)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
    tier = DiskTier(tmp_path, 1 << 30, NS, readers=readers)
    got = tier.get_many([_key(i) for i in range(64)], LAYOUT)
    assert all(g is not None and torch.equal(g.buffer, rows[i]) for i, g in enumerate(got))
    assert all(got[i + 1].buffer.data_ptr() == got[i].buffer.data_ptr() + LAYOUT.nbytes for i in range(63))
    s = tier.stats
    assert (s.queries, s.hits, s.errors, s.bytes_out) == (64, 64, 0, 64 * LAYOUT.nbytes)
    tier.close()


def _damage(path: Path, kind: str) -> None:
    blob = bytearray(path.read_bytes())
    if kind == "flipped_body_byte":
        blob[-1] ^= 0x40
    elif kind == "flipped_header_byte":  # the body length field
        blob[12] ^= 0x01
    elif kind == "truncated":
        blob = blob[:-100]
    elif kind == "truncated_header":
        blob = blob[:30]
    elif kind == "longer":
        blob += b"\0"
    elif kind == "empty":
        blob = bytearray()
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize(
    "kind",
    [
        "flipped_body_byte",
        "flipped_header_byte",
        "truncated",
        "truncated_header",
        "longer",
        "empty",
        "foreign_layout",
        "foreign_namespace",
    ],
)
def test_bad_file_among_many_is_a_counted_miss(tmp_path: Path, kind: str) -> None:
    rows = _rows(40, seed=1)
    _write(tmp_path, rows)
    bad = tmp_path / file_name(_key(17))
    if kind == "foreign_layout":  # a valid file of another layout under the key's name
        bad.write_bytes(encode_entry(_key(17), {"0.key": torch.zeros(8)}, NS))
    elif kind == "foreign_namespace":
        bad.write_bytes(encode_entry(_key(17), PackedPayload(rows[17].clone(), LAYOUT), "model-y/fp8"))
    else:
        _damage(bad, kind)
    tier = DiskTier(tmp_path, 1 << 30, NS, readers=4)
    got = tier.get_many([_key(i) for i in range(40)], LAYOUT)
    assert got[17] is None
    assert all(torch.equal(got[i].buffer, rows[i]) for i in range(40) if i != 17)
    s = tier.stats
    assert (s.queries, s.hits, s.errors) == (40, 39, 1)
    assert not bad.exists() and not tier.contains(_key(17))  # removed, forgotten
    tier.close()


def test_truncated_file_is_a_miss_without_a_layout_too(tmp_path: Path) -> None:
    rows = _rows(3, seed=2)
    _write(tmp_path, rows)
    _damage(tmp_path / file_name(_key(1)), "truncated")
    tier = DiskTier(tmp_path, 1 << 30, NS)
    assert tier.get(_key(1)) is None and tier.stats.errors == 1
    assert tier.get(_key(0)) is not None and tier.get(_key(2)) is not None
    tier.close()


def test_read_entry_checks_key_and_layout_but_not_padding(tmp_path: Path) -> None:
    """A file that differs only in its padding (not covered by the crc) is accepted; another key or
    layout is not."""
    payload = PackedPayload(_rows(1, seed=3)[0], LAYOUT)
    blob = bytearray(encode_entry(_key(5), payload, NS))
    body_at = len(blob) - LAYOUT.nbytes
    assert namespace_digest(NS) in blob[:body_at]
    path = tmp_path / "f"
    other = BlockLayout.of([("0.key", torch.float32, (len(blob),))])
    for padded in (False, True):
        if padded:
            blob[body_at - 1] = 7  # the last padding byte
        path.write_bytes(bytes(blob))
        out = torch.empty(LAYOUT.nbytes, dtype=torch.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            read_entry(fd, _key(5), NS, LAYOUT, out)
            with pytest.raises(BadEntry, match="stored key differs"):
                read_entry(fd, _key(6), NS, LAYOUT)
            with pytest.raises(BadEntry, match="layout differs"):
                read_entry(fd, _key(5), NS, other)
        finally:
            os.close(fd)
        assert torch.equal(out, payload.buffer)


def test_put_copies_so_the_callers_staging_is_free_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real_write = DiskTier._write

    def held_write(self: DiskTier, *args: object) -> None:
        assert release.wait(timeout=10)
        real_write(self, *args)

    monkeypatch.setattr(DiskTier, "_write", held_write)
    tier = DiskTier(tmp_path, 1 << 30, NS, writers=2)
    staging = _rows(12, seed=4)
    want = staging.clone()
    ref = StorageWeakRef(staging.untyped_storage())
    tier.put_many([_key(i) for i in range(12)], [PackedPayload(r, LAYOUT) for r in staging.unbind(0)])
    del staging
    assert ref.expired()  # nothing of the tier holds the caller's buffer while the writes wait
    got = tier.get_many([_key(i) for i in range(12)], LAYOUT)  # served from the queue, as copies
    assert all(torch.equal(g.buffer, want[i]) for i, g in enumerate(got))
    single = tier.get(_key(3))
    single.buffer.fill_(0)  # a copy: the queued block is unchanged
    release.set()
    tier.close()
    again = DiskTier(tmp_path, 1 << 30, NS)
    got = again.get_many([_key(i) for i in range(12)], LAYOUT)
    assert all(torch.equal(g.buffer, want[i]) for i, g in enumerate(got))
    assert again.stats.errors == 0
    again.close()


def test_queued_bytes_are_bounded(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, NS, max_pending_bytes=4 * LAYOUT.nbytes, writers=2)
    rows = _rows(50, seed=5)
    for start in range(0, 50, 5):  # more than fits at once: some may drop, none is wrong
        tier.put_many(
            [_key(i) for i in range(start, start + 5)], [PackedPayload(r, LAYOUT) for r in rows[start : start + 5]]
        )
    tier.flush()
    s = tier.stats
    written = len(list(tmp_path.glob("*.kvb")))
    assert written + s.dropped == 50 and written >= 4 and s.errors == 0
    assert tier._writer._pending_bytes == 0
    got = tier.get_many([_key(i) for i in range(50)], LAYOUT)
    assert all(g is None or torch.equal(g.buffer, rows[i]) for i, g in enumerate(got))
    assert sum(g is not None for g in got) == written
    tier.close()


def test_the_format_crc32_matches_zlib() -> None:
    """Whichever crc32 the format uses (ISA-L's when `isal` is installed, else zlib's), files written
    with one must verify with the other: the values must be zlib's."""
    from specserve.kv.offload import disk_io

    data = _rows(1, seed=7)[0].numpy()
    for start in (0, 1, 0xFFFFFFFF):
        assert disk_io.crc32(memoryview(data), start) == zlib.crc32(memoryview(data), start)


def test_offloader_disk_only_lookup_stops_at_a_bad_file(tmp_path: Path) -> None:
    from specserve.kv.quant import write_kv
    from specserve.kv.spec import KVCacheSpec, kv_format
    from tests.helpers.kv_gather import gather_kv

    fmt = kv_format("bfloat16", torch.bfloat16)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, fmt=fmt)
    caches = spec.allocate(48, torch.device("cpu"))
    g = torch.Generator().manual_seed(8)
    for cache in caches:
        write_kv(
            cache, fmt, torch.arange(24 * 4), torch.randn(96, 2, 16, generator=g), torch.randn(96, 2, 16, generator=g)
        )
    cfg = OffloadConfig(disk_path=str(tmp_path), disk_bytes=1 << 30)
    off = KVOffloader(cfg, caches, "ns", block_size=4)
    hashes = [b"h" + bytes([b]) for b in range(24)]
    for h, b in zip(hashes, range(24)):
        off.block_completed(h, b, computed=True)
    off.after_forward()
    off.close()
    _damage(tmp_path / file_name(hashes[20]), "flipped_body_byte")
    off = KVOffloader(cfg, caches, "ns", block_size=4)
    found = off.lookup(hashes)
    assert len(found) == 20 and off.disk.stats.errors == 1  # the run ends at the bad block
    off.load_into(list(range(24, 44)), found)
    for cache in caches:
        want = gather_kv(cache, fmt, torch.arange(20), 80, torch.float32)  # 20 blocks of 4 tokens
        got = gather_kv(cache, fmt, torch.arange(24, 44), 80, torch.float32)
        assert want[0].shape[0] == 80
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    off.close()
