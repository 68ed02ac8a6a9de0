"""Offload tiers: CPU LRU, disk files (budget, restart, corruption, concurrency, async writes),
and block extract / insert through a real paged cache."""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from specserve.kv.offload.cpu import CpuTier
from specserve.kv.offload.disk import DiskTier, file_name
from specserve.kv.offload.disk_io import encode_entry
from specserve.kv.offload.payload import BlockPayload, pack
from specserve.kv.offload.transfer import BlockMover
from specserve.kv.quant import write_kv
from specserve.kv.spec import KVCacheSpec, kv_format
from tests.helpers.kv_gather import gather_kv

NS = "model-a/fp8"


def _key(i: int) -> bytes:
    return b"ns01" + i.to_bytes(8, "little")


def _payload(i: int, numel: int = 256) -> BlockPayload:
    """Deterministic per key, so any process can check what another one wrote."""
    g = torch.Generator().manual_seed(i)
    return {
        "0.key": torch.randn(numel, generator=g).bfloat16(),
        "0.value": torch.randn(numel, generator=g).to(torch.float8_e4m3fn),
        "0.key_scale": torch.rand(numel // 16, generator=g).half(),
    }


def _same(a: BlockPayload | None, b: BlockPayload) -> bool:
    """Bit-exact equality (float8 has no torch.equal kernel on every build)."""
    if a is None or set(a) != set(b):
        return False
    return all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].view(torch.uint8), b[k].contiguous().view(torch.uint8))
        for k in b
    )


FILE_BYTES = len(encode_entry(_key(0), _payload(0), NS))


def _disk(path: Path, num_files: float, namespace: str = NS, **kw: int) -> DiskTier:
    return DiskTier(path, int(FILE_BYTES * num_files), namespace, **kw)


def test_cpu_lru_and_budget() -> None:
    size = pack(_payload(0)).nbytes
    tier = CpuTier(3 * size + size // 2, slot_bytes=size)
    for i in range(3):
        tier.put(_key(i), _payload(i))
    assert _same(tier.get(_key(0)), _payload(0))  # 0 becomes most recent
    tier.put(_key(3), _payload(3))  # evicts 1, the least recently used
    assert tier.keys() == [_key(2), _key(0), _key(3)]
    assert tier.get(_key(1)) is None and tier.used_bytes == 3 * size <= tier.capacity_bytes
    tier.put(_key(9), _payload(9, numel=4096))  # larger than the whole tier: not stored
    assert not tier.contains(_key(9)) and len(tier) == 3
    s = tier.stats
    assert (s.queries, s.hits, s.evictions, s.dropped) == (2, 1, 1, 1)
    assert s.bytes_in == 4 * size and s.bytes_out == size


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float32, torch.float16, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64],
)
def test_disk_exact_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    base = torch.randn(3, 5, 7) * 100
    tensor = base.to(torch.uint8) if dtype == torch.uint8 else base.to(dtype)
    payload = {"0.key": tensor, "0.key_scale": tensor[:, :, :2].contiguous()}
    tier = _disk(tmp_path, 4)
    tier.put(_key(1), payload)
    tier.close()
    again = _disk(tmp_path, 4)
    assert _same(again.get(_key(1)), payload)
    again.close()


def test_disk_lru_budget_and_restart(tmp_path: Path) -> None:
    tier = _disk(tmp_path, 3.5)
    for i in range(3):
        tier.put(_key(i), _payload(i))
    tier.flush()
    assert _same(tier.get(_key(0)), _payload(0))  # 0 is now the most recent
    tier.put(_key(3), _payload(3))
    tier.flush()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(file_name(_key(i)) for i in (0, 2, 3))
    assert tier.used_bytes == 3 * FILE_BYTES <= tier.capacity_bytes
    tier.close()

    restarted = _disk(tmp_path, 3.5)  # recency comes back from file mtimes: 2, 0, 3
    assert restarted.used_bytes == 3 * FILE_BYTES
    assert _same(restarted.get(_key(2)), _payload(2))  # order now 0, 3, 2
    restarted.put(_key(4), _payload(4))
    restarted.flush()
    assert not restarted.contains(_key(0))
    assert all(_same(restarted.get(_key(i)), _payload(i)) for i in (2, 3, 4))
    assert restarted.stats.errors == 0 and restarted.stats.evictions == 1
    restarted.close()
    smaller = _disk(tmp_path, 1.5)  # a smaller budget at startup evicts down to it
    assert [p.name for p in tmp_path.iterdir()] == [file_name(_key(4))]
    smaller.close()


def _corrupt(path: Path, kind: str, other: Path) -> None:
    blob = bytearray(path.read_bytes())
    if kind == "flipped_body_byte":
        blob[-10] ^= 0xFF
    elif kind == "truncated":
        blob = blob[: len(blob) // 2]
    elif kind == "wrong_version":
        struct.pack_into("<H", blob, 4, 99)
    elif kind == "garbage":
        blob = bytearray(os.urandom(300))
    elif kind == "empty":
        blob = bytearray()
    elif kind == "other_key":  # a valid file of another key under this key's name
        blob = bytearray(other.read_bytes())
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize(
    "kind", ["flipped_body_byte", "truncated", "wrong_version", "garbage", "empty", "other_key", "foreign_namespace"]
)
def test_bad_files_are_counted_misses(tmp_path: Path, kind: str) -> None:
    writer = _disk(tmp_path, 8)
    writer.put(_key(1), _payload(1))
    writer.put(_key(2), _payload(2))
    writer.close()
    path, other = tmp_path / file_name(_key(1)), tmp_path / file_name(_key(2))
    if kind != "foreign_namespace":
        _corrupt(path, kind, other)
    reader = _disk(tmp_path, 8, namespace="model-b/fp8" if kind == "foreign_namespace" else NS)
    assert reader.contains(_key(1))
    assert reader.get(_key(1)) is None
    assert reader.stats.errors == 1 and reader.stats.hits == 0
    assert not path.exists() and not reader.contains(_key(1))
    assert reader.used_bytes == FILE_BYTES  # only the other key's file is left
    reader.put(_key(1), _payload(1))  # a fresh write heals the entry
    reader.flush()
    assert _same(reader.get(_key(1)), _payload(1))
    reader.close()


def test_pending_writes_are_served_and_put_never_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real_write = DiskTier._write

    def slow_write(self: DiskTier, key: bytes, payload: BlockPayload, *args: object) -> None:
        release.wait(timeout=10)
        real_write(self, key, payload, *args)

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    tier = _disk(tmp_path, 100, max_pending_bytes=3 * pack(_payload(0)).nbytes)
    start = time.perf_counter()
    for i in range(5):  # the writer is stuck: 3 fit in the queue, 2 are dropped at once
        tier.put(_key(i), _payload(i))
    assert time.perf_counter() - start < 1.0
    assert tier.stats.dropped == 2
    assert tier.contains(_key(0)) and _same(tier.get(_key(0)), _payload(0))
    assert not (tmp_path / file_name(_key(0))).exists()
    release.set()
    tier.flush()
    assert all((tmp_path / file_name(_key(i))).exists() for i in range(3))
    assert not tier.contains(_key(4))
    tier.close()
    with pytest.raises(RuntimeError):
        tier.put(_key(7), _payload(7))


def test_failed_write_is_counted_and_writer_survives(tmp_path: Path) -> None:
    tier = _disk(tmp_path, 10)
    tier.put(_key(1), {"0.key": torch.empty(4, device="meta")})  # cannot be serialized
    tier.put(_key(2), _payload(2))
    tier.flush()
    assert tier.stats.errors == 1 and tier.get(_key(1)) is None
    assert _same(tier.get(_key(2)), _payload(2))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
    tier.close()


def _writer_process(path: str, first: int, count: int, barrier: threading.Barrier) -> None:
    tier = DiskTier(path, 1 << 30, NS)
    barrier.wait(timeout=60)  # both processes are up (torch imported): now the writes overlap
    for i in range(first, first + count):
        tier.put(_key(i), _payload(i))
        if i % 4 == 3:
            tier.get(_key(i - 1))  # reads racing with the other writer
    tier.close()


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    # Keys 20..39 are written by both processes at about the same time.
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer_process, args=(str(tmp_path), first, 40, barrier)) for first in (0, 20)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    reader = _disk(tmp_path, 1000)
    assert reader.used_bytes == 60 * FILE_BYTES
    assert all(_same(reader.get(_key(i)), _payload(i)) for i in range(60))
    assert reader.stats.errors == 0
    reader.close()


def test_other_instance_sees_new_files(tmp_path: Path) -> None:
    a, b = _disk(tmp_path, 10), _disk(tmp_path, 10)
    a.put(_key(5), _payload(5))
    a.flush()
    assert b.contains(_key(5)) and _same(b.get(_key(5)), _payload(5))
    assert b.used_bytes == FILE_BYTES
    a.close()
    b.close()


def _extract(caches: list, block_ids: list[int]) -> list:
    return [p for rows in BlockMover(caches).gather_to_host(block_ids) for p in rows.payloads()]


def _insert(caches: list, block_ids: list[int], payloads: list) -> None:
    mover = BlockMover(caches)
    mover.load_from_host(block_ids, mover.check(payloads))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8", "nvfp4"])
def test_block_extract_insert_through_disk(tmp_path: Path, kv_dtype: str) -> None:
    fmt = kv_format(kv_dtype, torch.bfloat16)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=4, fmt=fmt)
    src = spec.allocate(6, torch.device("cpu"))
    key, value = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7])  # blocks 3 and 1
    for cache in src:
        write_kv(cache, fmt, slots, key, value)
    tier = DiskTier(tmp_path, 1 << 20, f"m/{kv_dtype}")
    for block_id, payload in zip((3, 1), _extract(src, [3, 1])):
        assert _same(payload, _extract(src, [block_id])[0])
        tier.put(_key(block_id), payload)
    tier.close()
    reader = DiskTier(tmp_path, 1 << 20, f"m/{kv_dtype}")
    dst = spec.allocate(6, torch.device("cpu"))
    _insert(dst, [0], [reader.get(_key(3))])
    _insert(dst, [5], [reader.get(_key(1))])
    for s_cache, d_cache in zip(src, dst):
        want = gather_kv(s_cache, fmt, torch.tensor([3, 1]), 8, torch.float32)
        got = gather_kv(d_cache, fmt, torch.tensor([0, 5]), 8, torch.float32)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    other = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=8, fmt=fmt)
    with pytest.raises(ValueError, match="payload"):
        _insert(other.allocate(2, torch.device("cpu")), [0], [reader.get(_key(3))])
    reader.close()


def test_get_many_reads_into_one_buffer_and_rejects_bad_files(tmp_path: Path) -> None:
    writer = _disk(tmp_path, 20)
    for i in range(6):
        writer.put(_key(i), _payload(i))
    writer.put(_key(9), {"0.key": torch.zeros(8)})  # another layout, same namespace
    writer.close()
    flip = bytearray((tmp_path / file_name(_key(2))).read_bytes())
    flip[-3] ^= 0x01
    (tmp_path / file_name(_key(2))).write_bytes(bytes(flip))
    with open(tmp_path / file_name(_key(3)), "ab") as f:  # appended bytes: a longer file
        f.write(b"x")
    (tmp_path / file_name(_key(4))).write_bytes((tmp_path / file_name(_key(4))).read_bytes()[:-7])
    reader = _disk(tmp_path, 20)
    layout = pack(_payload(0)).layout
    keys = [_key(i) for i in (0, 1, 2, 3, 4, 5, 9, 7)]  # 7 was never written
    got = reader.get_many(keys, layout)
    assert [g is not None for g in got] == [True, True, False, False, False, True, False, False]
    assert _same(got[0], _payload(0)) and _same(got[1], _payload(1)) and _same(got[5], _payload(5))
    assert got[1].buffer.data_ptr() == got[0].buffer.data_ptr() + layout.nbytes  # rows of one buffer
    s = reader.stats
    assert (s.queries, s.hits, s.errors) == (8, 3, 4)
    assert not any((tmp_path / file_name(_key(i))).exists() for i in (2, 3, 4, 9))
    assert _same(reader.get(_key(5)), _payload(5))  # without a layout: any layout
    reader.close()
