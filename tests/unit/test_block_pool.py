"""Block pool and KV manager invariants under long random operation sequences."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from specserve.kv.block_pool import BlockPool, hash_blocks
from specserve.kv.manager import KVCacheManager
from specserve.sampling_params import SamplingParams
from specserve.scheduler.request import Request


def hash_block_tokens(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """The stored hash of one block, spelled out: blake2b-128(parent or b"root", int64 tokens, extra)."""
    data = (parent or b"root") + np.asarray(token_ids, dtype=np.int64).tobytes() + extra
    return hashlib.blake2b(data, digest_size=16).digest()


def test_hash_is_chained_and_stable():
    assert hash_blocks(None, [1, 2, 3], 3) == [hash_block_tokens(None, [1, 2, 3])]
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(a, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 3], b"model-a") != hash_block_tokens(None, [1, 2, 3], b"model-b")


def test_hash_blocks_equals_the_chain_of_single_hashes():
    rng = random.Random(3)
    tokens = [rng.randrange(0, 200000) for _ in range(4 * 5)]
    chain, parent = [], b"p0"
    for i in range(5):
        parent = hash_block_tokens(parent, tokens[i * 4 : (i + 1) * 4], b"x")
        chain.append(parent)
    assert hash_blocks(b"p0", tokens, 4, b"x") == chain
    assert hash_blocks(None, tokens[:4], 4) == [hash_block_tokens(None, tokens[:4])]


def test_pool_lru_evicts_least_recently_freed_cached_block():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    for i, b in enumerate(ids):
        pool.cache_block(b, bytes([i]))
    pool.free([ids[2]])
    pool.free([ids[0]])
    evicted = []
    pool.on_evict = lambda h, b: evicted.append(b)
    assert pool.allocate(1) == [ids[2]]
    assert evicted == [ids[2]] and pool.lookup(bytes([2])) is None
    assert pool.lookup(bytes([0])) == ids[0]
    assert pool.allocate(2) is None  # only one free block left: nothing taken
    pool.check_integrity({ids[1]: 1, ids[3]: 1, ids[2]: 1})


def test_double_free_is_caught():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 4)


@pytest.mark.parametrize("seed", range(6))
def test_manager_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=seed % 2 == 0)
    live: dict[str, Request] = {}
    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    for step in range(400):
        op = rng.random()
        if op < 0.35 and len(live) < 8:
            tokens = rng.choice(prefixes)[: rng.randint(0, 12)] + [rng.randrange(100) for _ in range(rng.randint(1, 9))]
            req = _req(f"r{step}", tokens)
            hits, n_hit = kv.get_computed_blocks(req)
            assert n_hit % 4 == 0 and n_hit < len(tokens)
            if kv.allocate_slots(req, len(tokens) - n_hit, hits, rng.choice([0, 2])):
                req.num_computed_tokens = len(tokens)
                live[req.request_id] = req
        elif op < 0.75 and live:
            req = live[rng.choice(list(live))]
            before = list(kv.block_ids(req.request_id))
            req.append_output_tokens([rng.randrange(100)])
            if kv.allocate_slots(req, 1):
                req.num_computed_tokens += 1
                assert kv.block_ids(req.request_id)[: len(before)] == before
                need = -(-req.num_computed_tokens // 4)
                assert len(kv.block_ids(req.request_id)) >= need
            else:
                req.all_token_ids.pop()
                req.output_token_ids.pop()
        elif live:
            kv.free(live.pop(rng.choice(list(live))))
        kv.check_integrity()
        used = sum(len(set(kv.block_ids(r))) for r in live)
        assert kv.num_free_blocks() >= kv.num_blocks - used
    for req in list(live.values()):
        kv.free(req)
    kv.check_integrity()
    assert kv.usage() == 0.0


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    b = _req("b", list(range(12)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8  # the last block is not taken: its final token must be recomputed for logits
    assert hits == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, 4, hits)
    assert kv.pool.blocks[hits[0]].ref_cnt == 2
    kv.check_integrity()
