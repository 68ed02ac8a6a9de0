"""Disk tier throughput on the CPU: store and load of ~200 MB of KV blocks (issue 6).

Store: the blocks go the engine's way (HostRows groups -> StoreQueue worker -> TieredStore([disk])
-> writers). Reported: the caller's time (what the engine thread pays), when the staging rows are
released (a held pinned staging buffer makes the next request allocate pinned memory), the time
until every file is written (MB/s) and the process CPU time per block (all threads). With
--engine-proxy, engine-like Python work runs on the calling thread meanwhile and its speed vs idle
is reported instead: the GIL the store takes from the engine (meaningful with spare cores only).
Load: a new tier on the same directory (a restart) reads every block with `get_many(keys, layout)`,
page cache hot (the H200 bench case) and, with --cold, after dropping the files from the page cache.
Tiny blocks on tmpfs (--layers 1 --kv-heads 1 --head-dim 16 --dir /dev/shm) leave mostly the Python
per block: what the threads serialize on.

    python bench/disk_tier_io.py                 # 448 blocks of qwen2.5-1.5b (bf16, 16 tokens): 205 MB
    python bench/disk_tier_io.py --blocks 64     # quick
    python bench/disk_tier_io.py --impl mypkg.old_disk   # another DiskTier (before/after in one session)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import importlib  # noqa: E402

from specserve.kv.offload.payload import BlockLayout  # noqa: E402
from specserve.kv.offload.store_queue import StoreQueue  # noqa: E402
from specserve.kv.offload.tiered import TieredStore  # noqa: E402
from specserve.kv.offload.transfer import MAX_STAGING_BYTES, HostRows  # noqa: E402


def _layout(layers: int, heads: int, head_dim: int, block_size: int) -> BlockLayout:
    shape = (block_size, heads, head_dim)
    return BlockLayout.of([(f"{i}.{n}", torch.bfloat16, shape) for i in range(layers) for n in ("key", "value")])


def _engine_rate(stop: threading.Event | None, seconds: float) -> float:
    """Iterations per second of engine-like host work (Python + tiny torch ops, which release the
    GIL like kernel launches do) until `stop` is set or `seconds` pass."""
    a = torch.ones(8)
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(50):
            a = a.add(1.0).mul_(0.5)
            _ = [i * 2 for i in range(20)]
        n += 50
        dt = time.perf_counter() - t0
        if (stop is not None and stop.is_set()) or (stop is None and dt >= seconds) or dt > 60:
            return n / dt


def store(tier_cls, path: str, keys: list[bytes], layout: BlockLayout, source: torch.Tensor, proxy: bool,
          **tier_kw: int) -> list[dict]:
    """Two rounds on one tier (the second with other keys): a server stores all the time, so
    the second round is the steady state (memory the tier reuses is warm)."""
    disk = tier_cls(path, 1 << 40, "bench", max_pending_bytes=1 << 40, **tier_kw)
    tiers = TieredStore([disk])
    queue = StoreQueue("bench-store")
    try:
        return [_store_round(tiers, queue, disk, keys, layout, source, proxy),
                _store_round(tiers, queue, disk, [b"round2-" + k for k in keys], layout, source, proxy)]
    finally:
        queue.close()
        tiers.close()


def _store_round(tiers: TieredStore, queue: StoreQueue, disk, keys: list[bytes], layout: BlockLayout,
                 source: torch.Tensor, proxy: bool) -> dict:
    idle = _engine_rate(None, 0.5) if proxy else 0.0
    group = max(1, MAX_STAGING_BYTES // layout.nbytes)
    done, flushed, released, written = threading.Event(), threading.Event(), {}, {}
    starts = range(0, len(keys), group)
    staging = [source[start:start + group].clone() for start in starts]  # (pinned on CUDA)
    refs = [StorageWeakRef(rows.untyped_storage()) for rows in staging]
    t0, cpu0 = time.perf_counter(), time.process_time()
    for start in starts:  # what after_forward does: one HostRows per group
        rows = staging.pop(0)
        queue.submit_rows(keys[start:start + group], HostRows(rows, layout, None), tiers.put_many)
        del rows
    caller_s = time.perf_counter() - t0

    def waiter() -> None:
        # Staging is released at the latest when its blocks are written (or never, if something
        # keeps a reference after that: reported as nan).
        while not all(r.expired() for r in refs) and not flushed.is_set():
            time.sleep(0.001)
        if all(r.expired() for r in refs):
            released["s"] = time.perf_counter() - t0
        done.set()

    def flusher() -> None:
        queue.flush()
        tiers.flush()
        written["s"] = time.perf_counter() - t0
        written["cpu"] = time.process_time() - cpu0  # every thread of the process
        flushed.set()

    threading.Thread(target=waiter, daemon=True).start()
    threading.Thread(target=flusher, daemon=True).start()
    busy = _engine_rate(flushed, 0) if proxy else flushed.wait(60)
    done.wait(60)
    total_s = written["s"]
    stats = disk.stats
    mb = len(keys) * layout.nbytes / 1e6
    return {"MB": round(mb, 1), "caller_ms": round(1e3 * caller_s, 1),
            "staging_released_ms": round(1e3 * released.get("s", float("nan")), 1),
            "written_ms": round(1e3 * total_s, 1), "store_MB_s": round(mb / total_s),
            **({"engine_rate_vs_idle": round(busy / idle, 2)} if proxy else
               {"cpu_us_per_block": round(1e6 * written["cpu"] / len(keys), 1)}),
            "errors": stats.errors, "dropped": stats.dropped}


def _drop_page_cache(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load(tier_cls, path: str, keys: list[bytes], layout: BlockLayout, source: torch.Tensor, repeats: int,
         cold: bool, **tier_kw: int) -> dict:
    times, cpus = [], []
    for _ in range(repeats):
        if cold:
            _drop_page_cache(path)
        disk = tier_cls(path, 1 << 40, "bench", **tier_kw)  # a restart: the index comes from the directory
        t0, cpu0 = time.perf_counter(), time.process_time()
        got = disk.get_many(keys, layout)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - cpu0)
        bad = sum(g is None or not torch.equal(g.buffer, source[i]) for i, g in enumerate(got))
        assert bad == 0 and disk.stats.errors == 0, f"{bad} blocks differ"
        del got
        disk.close()
    mb = len(keys) * layout.nbytes / 1e6
    med = statistics.median(times)
    return {"MB": round(mb, 1), "load_ms_median": round(1e3 * med, 1), "load_ms_min": round(1e3 * min(times), 1),
            "load_MB_s": round(mb / med), "cpu_us_per_block": round(1e6 * statistics.median(cpus) / len(keys), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=448)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cold", action="store_true", help="also load with the files dropped from the page cache")
    p.add_argument("--dir", default=None, help="where the block files go (default: a temp dir)")
    p.add_argument("--engine-proxy", action="store_true",
                   help="run engine-like Python work during the store and report its speed vs idle (on a "
                        "machine with spare cores: with 2 cores it measures CPU contention, not the GIL)")
    p.add_argument("--readers", type=int, default=None, help="DiskTier(readers=...) (default: its own)")
    p.add_argument("--writers", type=int, default=None, help="DiskTier(writers=...) (default: its own)")
    p.add_argument("--impl", default="specserve.kv.offload.disk",
                   help="module with the DiskTier to time (e.g. a copy of an older one, for before/after)")
    args = p.parse_args()
    tier_cls = importlib.import_module(args.impl).DiskTier
    read_kw = {} if args.readers is None else {"readers": args.readers}
    write_kw = {} if args.writers is None else {"writers": args.writers}
    layout = _layout(args.layers, args.kv_heads, args.head_dim, args.block_size)
    keys = [b"bench-key-" + i.to_bytes(8, "little") for i in range(args.blocks)]
    source = torch.randint(0, 256, (args.blocks, layout.nbytes), dtype=torch.uint8)
    print(f"{args.impl}: {args.blocks} blocks of {layout.nbytes} bytes, {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="disk-tier-io-") as path:
        for i, row in enumerate(store(tier_cls, path, keys, layout, source, args.engine_proxy, **write_kw)):
            print(f"store round {i + 1}:", row, flush=True)
        print("load (page cache hot):", load(tier_cls, path, keys, layout, source, args.repeats, False, **read_kw),
              flush=True)
        if args.cold:
            print("load (page cache dropped):", load(tier_cls, path, keys, layout, source,
                                                      max(1, args.repeats // 2), True, **read_kw), flush=True)


if __name__ == "__main__":
    main()
