"""Draft-tree attention (AttentionMetadata.tree_mask) in the Triton paged kernel against the torch
reference: random trees mixed with causal rows (a prefill, a chain), with and without split-KV."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from specserve.attention.tree_mask import tree_inputs
from tests.gpu.test_triton_attention import assert_close, make_batch, reference, write_cache


def _random_parents(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(i + 1) for i in range(n)]  # node i + 1's parent: any earlier node


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_mask_matches_the_reference(device: torch.device, num_splits: int, seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.randrange(2, 12), rng.randrange(2, 12)]
    specs = [(37, sizes[0] + 1), (0, 20), (50, sizes[1] + 1), (21, 4)]  # tree, prefill, tree, chain
    batch = make_batch(specs, 4, 2, 64, 16, torch.float32, device, seed=seed)
    cu = np.cumsum([0] + [n for _, n in specs])
    seq_index = np.repeat(np.arange(len(specs)), [n for _, n in specs])
    trees = [(int(cu[0]), _random_parents(rng, sizes[0])), (int(cu[2]), _random_parents(rng, sizes[1]))]
    positions = np.zeros(int(cu[-1]), dtype=np.int64)
    mask = torch.from_numpy(tree_inputs(trees, positions, cu, seq_index)).to(device)
    batch = batch._replace(  # both metadata on `device`, as make_batch builds them
        meta=dataclasses.replace(batch.meta, tree_mask=mask),
        ref_meta=dataclasses.replace(batch.ref_meta, tree_mask=mask),
    )
    ref, _ = reference(batch)
    write_cache(batch)
    from specserve.attention.triton_paged import paged_attention

    m = batch.meta
    out = paged_attention(
        batch.q,
        batch.cache.key,
        batch.cache.value,
        m.cu_query_lens,
        m.seq_lens,
        m.block_tables,
        m.max_query_len,
        m.max_seq_len,
        batch.scale,
        num_splits=num_splits,
        tree_mask=m.tree_mask,
    )
    assert_close(out, ref, torch.float32)
    causal, _ = reference(batch._replace(ref_meta=dataclasses.replace(batch.ref_meta, tree_mask=None)))
    assert (causal - ref).abs().max() > 1e-3  # the trees changed what their rows see
