"""Offload internals: the slot slab, CPU tier slots and leases, packed payloads, and the
asynchronous store path of KVOffloader (visible only once copied; snapshots taken before the
block is reused), on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from specserve.config import OffloadConfig
from specserve.kv.offload import transfer
from specserve.kv.offload.cpu import CpuTier, SlotSlab
from specserve.kv.offload.offloader import KVOffloader
from specserve.kv.offload.payload import BlockLayout, PackedPayload, contiguous_runs, pack
from specserve.kv.quant import write_kv
from specserve.kv.spec import KVCacheSpec, kv_format
from tests.helpers.kv_gather import gather_kv


def _payload(i: int, numel: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"0.key": torch.randn(numel, generator=g).bfloat16(), "0.value": torch.randn(numel, generator=g)}


def _same(a, b) -> bool:
    return (
        a is not None
        and set(a) == set(b)
        and all(torch.equal(a[k].view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in b)
    )


def test_slab_slots_in_chunks() -> None:
    slab = SlotSlab(slot_bytes=100, num_slots=5, chunk_bytes=250)
    assert [c.numel() for c in slab._chunks] == [200, 200, 100]  # chunks of 2, 2, 1 slots
    slots = [slab.allocate() for _ in range(5)]
    assert slots == [0, 1, 2, 3, 4] and slab.allocate() is None
    views = [slab.view(s) for s in slots]
    assert all(v.numel() == 100 for v in views)
    assert views[1].data_ptr() == views[0].data_ptr() + 100  # same chunk: adjacent
    for i, v in enumerate(views):
        v.fill_(i)
    assert [int(slab.view(s)[0]) for s in slots] == slots  # no two slots share memory
    slab.free(3)
    assert slab.allocate() == 3


def test_cpu_tier_reuses_slots_lru_and_never_a_leased_one() -> None:
    size = pack(_payload(0)).nbytes
    tier = CpuTier(3 * size + size // 2, slot_bytes=size, pin_memory=False)
    for i in range(3):
        tier.put(bytes([i]), _payload(i))
    held = tier.get(bytes([0]))  # a reader (an H2D copy in flight) holds key 0's slot
    for i in (1, 2):
        assert _same(tier.get(bytes([i])), _payload(i))  # 0 is now least recently used
    tier.put(bytes([3]), _payload(3))  # evicts 1: 0's slot is leased
    assert tier.keys() == [bytes([0]), bytes([2]), bytes([3])]
    assert _same(held, _payload(0))  # not overwritten
    key_view = held["0.key"]
    del held  # a view keeps the lease too
    tier.put(bytes([4]), _payload(4))
    assert tier.keys() == [bytes([0]), bytes([3]), bytes([4])]
    assert _same({"0.key": key_view}, {"0.key": _payload(0)["0.key"]})
    del key_view
    tier.put(bytes([5]), _payload(5))  # now 0 goes
    assert tier.keys() == [bytes([3]), bytes([4]), bytes([5])]
    assert tier.used_bytes == 3 * size <= tier.capacity_bytes and tier._slab.num_slots == 3
    tier.put(bytes([9]), _payload(9, numel=32))  # another slot size: not stored
    assert not tier.contains(bytes([9]))
    s = tier.stats
    assert (s.evictions, s.dropped, s.bytes_in) == (3, 1, 6 * size)


def test_cpu_tier_when_every_slot_is_leased_drops() -> None:
    size = pack(_payload(0)).nbytes
    tier = CpuTier(2 * size, slot_bytes=size, pin_memory=False)
    tier.put(b"a", _payload(1))
    tier.put(b"b", _payload(2))
    held = [tier.get(b"a"), tier.get(b"b")]
    tier.put(b"c", _payload(3))
    assert not tier.contains(b"c") and tier.stats.dropped == 1 and len(held) == 2


def test_cpu_tier_preallocated_slots_and_get_many() -> None:
    size = pack(_payload(0)).nbytes
    tier = CpuTier(4 * size, pin_memory=False, slot_bytes=size, chunk_bytes=2 * size)
    assert tier._slab.num_slots == 4 and tier.used_bytes == 0  # the budget is taken up front
    for i in range(3):
        tier.put(bytes([i]), _payload(i))
    got = tier.get_many([bytes([0]), bytes([1]), b"missing", bytes([2])])  # stops at the miss
    assert len(got) == 2 and all(_same(g, _payload(i)) for i, g in enumerate(got))
    assert tier.keys() == [bytes([2]), bytes([0]), bytes([1])]
    assert got[1].buffer.data_ptr() == got[0].buffer.data_ptr() + size  # stored in order: adjacent
    s = tier.stats
    assert (s.queries, s.hits, s.bytes_out) == (3, 2, 2 * size)


def test_packed_payload_views_and_runs() -> None:
    layout = BlockLayout.of([("a", torch.float16, (3,)), ("b", torch.float32, (2, 2))])
    assert [e.offset for e in layout.entries] == [0, 16] and layout.nbytes == 32  # aligned to 16
    assert BlockLayout.from_json(layout.json) == layout
    rows = torch.zeros(4, layout.nbytes, dtype=torch.uint8)
    payloads = [PackedPayload(r, layout) for r in rows.unbind(0)]
    payloads[1]["b"].fill_(2.0)
    assert rows[1, 16:].view(torch.float32).eq(2.0).all()
    other = torch.zeros(layout.nbytes, dtype=torch.uint8)
    runs = contiguous_runs([payloads[0].buffer, payloads[1].buffer, other, payloads[3].buffer])
    assert [(i, j, r.numel()) for i, j, r in runs] == [(0, 2, 64), (2, 3, 32), (3, 4, 32)]
    assert runs[0][2].data_ptr() == rows.data_ptr()
    with pytest.raises(ValueError):
        BlockLayout.from_json(b'[["a","not_a_dtype",[3],0]]')


# -- the store path through KVOffloader --------------------------------------------------------


def _caches(kv_dtype: str = "fp8", num_blocks: int = 8):
    fmt = kv_format(kv_dtype, torch.bfloat16)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=4, fmt=fmt)
    return spec.allocate(num_blocks, torch.device("cpu")), fmt


def _fill(caches, fmt, block_id: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(block_id * 4, block_id * 4 + 4)
    for cache in caches:
        write_kv(cache, fmt, slots, torch.randn(4, 2, 32, generator=g), torch.randn(4, 2, 32, generator=g))


def _block(caches, fmt, block_id: int) -> list[torch.Tensor]:
    out = []
    for cache in caches:
        out.extend(gather_kv(cache, fmt, torch.tensor([block_id]), 4, torch.float32))
    return out


class _Gate:
    """Holds every device->host copy 'in flight' until opened (HostRows.wait blocks)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        real = transfer.HostRows.wait

        def wait(rows: transfer.HostRows) -> None:
            assert self.open.wait(timeout=10)
            real(rows)

        monkeypatch.setattr(transfer.HostRows, "wait", wait)


def _offloader(caches, cpu_bytes: int = 1 << 20) -> KVOffloader:
    return KVOffloader(OffloadConfig(cpu_bytes=cpu_bytes), caches, "ns", block_size=4)


def test_store_is_visible_only_once_copied_and_is_a_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    caches, fmt = _caches()
    for b in (1, 2):
        _fill(caches, fmt, b, seed=b)
    want = {b: _block(caches, fmt, b) for b in (1, 2)}
    gate = _Gate(monkeypatch)
    off = _offloader(caches)
    off.block_completed(b"h1", 1)
    off.block_completed(b"h2", 2)
    off.after_forward()  # gathers now; the copy "lands" only when the gate opens
    assert not off.cpu.contains(b"h1") and off.queue.pending(b"h1")
    _fill(caches, fmt, 1, seed=99)  # the GPU reuses block 1 before the copy has landed
    gate.open.set()
    found = off.lookup([b"h1", b"h2", b"h3"])  # waits for the blocks on their way
    assert len(found) == 2 and off.cpu.contains(b"h1")
    off.load_into([5, 6], found)
    for got, exp in zip(_block(caches, fmt, 5) + _block(caches, fmt, 6), want[1] + want[2]):
        assert torch.equal(got, exp)
    off.close()


def test_evicted_blocks_are_snapshotted_before_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    caches, fmt = _caches("bfloat16")
    for b in (3, 4, 5):
        _fill(caches, fmt, b, seed=b)
    want = {b: _block(caches, fmt, b) for b in (3, 4, 5)}
    gate = _Gate(monkeypatch)
    off = _offloader(caches)
    with off.batch_evictions():  # what the manager does around pool.allocate
        off.on_evict(b"h3", 3)
        off.on_evict(b"h4", 4)
        assert not off.queue.pending(b"h3")  # collected, gathered together on leaving
    assert off.queue.pending(b"h3") and off.queue.pending(b"h4")
    off.on_evict(b"h5", 5)  # outside a batch: gathered at once
    for b in (3, 4, 5):  # the blocks are rewritten by their new owners
        _fill(caches, fmt, b, seed=100 + b)
    gate.open.set()
    off.queue.flush()
    for h, b in ((b"h3", 3), (b"h4", 4), (b"h5", 5)):
        off.load_into([0], [off.cpu.get(h)])
        assert all(torch.equal(x, y) for x, y in zip(_block(caches, fmt, 0), want[b]))
    off.close()


def test_block_evicted_before_its_forward_is_not_stored() -> None:
    caches, _ = _caches()
    off = _offloader(caches)
    off.block_completed(b"never", 2, computed=False)  # scheduled, its forward not run yet
    off.on_evict(b"never", 2)  # freed and reused before that forward (preemption)
    off.block_completed(b"done", 3, computed=True)  # computed earlier (async scheduling)
    off.on_evict(b"done", 3)
    off.after_forward()
    off.queue.flush()
    assert not off.cpu.contains(b"never") and off.cpu.contains(b"done")
    off.close()


def test_store_skips_known_blocks_and_close_flushes(tmp_path) -> None:
    caches, fmt = _caches()
    _fill(caches, fmt, 1, seed=1)
    off = KVOffloader(
        OffloadConfig(cpu_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 << 20), caches, "ns", block_size=4
    )
    off.block_completed(b"k", 1)
    off.after_forward()
    off.block_completed(b"k", 1)  # completed again (another request): already stored
    off.after_forward()
    off.close()  # drains the store queue and the disk writer
    assert off.cpu.stats.bytes_in == off.disk.stats.bytes_in == off.mover.layout.nbytes
    assert len(list(tmp_path.glob("*.kvb"))) == 1


@pytest.mark.parametrize(
    "dst",
    [
        [20, 21, 22, 5, 6, 7, 8, 9, 10, 11, 12, 13],  # runs: slice copies
        [23, 1, 19, 3, 17, 5, 15, 7, 13, 9, 11, 2],
    ],
)  # scattered: index_copy_
def test_insert_blocks_into_any_ids(dst: list[int]) -> None:
    caches, fmt = _caches("nvfp4", num_blocks=24)
    for b in range(12):
        _fill(caches, fmt, b, seed=b)
    want = [_block(caches, fmt, b) for b in range(12)]
    mover = transfer.BlockMover(caches)
    payloads = [p for rows in mover.gather_to_host(list(range(12))) for p in rows.payloads()]
    mover.load_from_host(dst, mover.check(payloads))
    for b, d in enumerate(dst):
        assert all(torch.equal(x, y) for x, y in zip(_block(caches, fmt, d), want[b]))
