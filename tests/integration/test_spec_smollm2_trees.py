"""Draft trees on the real SmolLM2-135M-Instruct: with trees on, every method gives exactly the plain
engine's greedy tokens (n-gram, the draft model and the EAGLE / EAGLE-3 heads draft real trees; P-EAGLE
trees branching at the first level), under preemption; an EAGLE-3 tree's greedy path is what the head drafts as a
chain; and after tree steps the request's KV equals the KV plain prefill computes for the same tokens (the
accepted nodes' KV was moved into place, the rejected branches' left behind)."""

from __future__ import annotations

import pytest
import torch

import specserve.speculative.decoder as decoder_module
from specserve import LLM, SamplingParams
from tests.integration import test_spec_smollm2_methods as base
from tests.integration.test_spec_smollm2_methods import (
    MAX_MODEL_LEN,
    MODEL,
    PREEMPT_BLOCKS,
    ROOMY_BYTES,
    _counters,
    _generate,
    _spec_config,
)

plain, prompts, reference, heads = base.plain, base.prompts, base.reference, base.heads  # shared fixtures

TREE = {"tree_branching": 3, "tree_node_budget": 8}


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of KV slots each tree compaction moved."""
    seen: list[int] = []
    real = decoder_module.compact_kv

    def counting(caches, src, dst) -> None:
        seen.append(len(src))
        real(caches, src, dst)

    monkeypatch.setattr(decoder_module, "compact_kv", counting)
    return seen


def _tree_config(method: str, heads: dict[str, str]) -> dict:
    if method == "draft_model":  # the target drafting for itself: its trees' greedy paths get accepted
        return {"method": "draft_model", "model": MODEL, "num_speculative_tokens": base.K, "adaptive": False, **TREE}
    return {**_spec_config(method, heads), **TREE}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3", "p-eagle"])
def test_greedy_equals_plain_with_trees(
    method: str, plain: LLM, prompts: list[list[int]], reference: list[list[int]], heads: dict[str, str], moves
) -> None:
    llm = LLM(
        model=MODEL,
        progress=False,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=PREEMPT_BLOCKS * plain.engine.runner.spec.bytes_per_block,
        speculative_config=_tree_config(method, heads),
    )
    got = _generate(llm, prompts)
    c = _counters(llm)
    for i, (g, r) in enumerate(zip(got, reference)):
        assert g == r, f"{method} with trees: prompt {i} differs from plain decoding; {c}"
    assert c["num_preemptions_total"] > 0 and c["spec_decode_num_drafts_total"] > 0, c
    if method in ("ngram", "draft_model"):  # real trees: some accepted path left the first branch
        assert c["spec_decode_num_accepted_tokens_total"] > 0 and any(moves), (c, moves)
        per_depth = [llm.engine.stats.get("spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"})]
        assert per_depth[0] > 0
    llm.engine.kv.check_integrity()
    assert llm.engine.num_blocks_in_use() == 0


def _greedy_paths(llm: LLM, tree: bool) -> dict[tuple[int, int], list[int]]:
    """Record, per (request's first prompt token, output length), the drafts' greedy path: the first child
    of each node from the root (a chain: the chain)."""
    proposer, name, seen = llm.engine.spec.proposer, "propose_tree" if tree else "propose", {}
    real = getattr(proposer, name)

    def recording(inp, *shape) -> None:
        real(inp, *shape)
        proposer.resolve_deferred()
        for r in inp.requests:
            parents, node, path = r.spec_tree_parents or list(range(len(r.spec_token_ids))), 0, []
            while node in parents:
                node = parents.index(node) + 1
                path.append(r.spec_token_ids[node - 1])
            seen[r.prompt_token_ids[0], r.num_output_tokens] = path

    setattr(proposer, name, recording)
    return seen


def test_eagle3_tree_greedy_path_is_the_chain(prompts: list[list[int]], heads: dict[str, str]) -> None:
    """The random head's drafts are all rejected, so both engines see the same states: the tree's greedy path is
    a prefix of the chain (the rest may fall outside the budget), and it reaches past depth 1."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    paths = []
    for cfg in (_spec_config("eagle3", heads), _tree_config("eagle3", heads)):
        llm = LLM(model=MODEL, progress=False, max_model_len=MAX_MODEL_LEN, speculative_config=cfg)
        paths.append(_greedy_paths(llm, "tree_branching" in cfg))
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params)
    chain, tree = paths
    assert chain.keys() == tree.keys() and len(chain) > 4
    assert all(tree[k] and tree[k] == chain[k][: len(tree[k])] for k in chain), (chain, tree)
    assert any(len(p) > 1 for p in tree.values()), tree


def _kv(llm: LLM, request_id: str, n: int) -> list[torch.Tensor]:
    """Every layer's key and value at positions 0..n-1 of a running request."""
    eng = llm.engine
    bs, blocks = eng.kv.block_size, eng.kv.block_ids(request_id)
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
    return [t.view(-1, *t.shape[2:])[slots] for layer in eng.runner.kv_caches for t in layer[:2]]


def test_kv_after_tree_steps_equals_plain_prefill(moves: list[int]) -> None:
    prompt = "1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 4, 1, 2,"
    cfg = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4}
    spec = LLM(
        model=MODEL,
        progress=False,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=ROOMY_BYTES,
        speculative_config={**cfg, "adaptive": False, **TREE},
    )
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    spec.engine.add_request("tree", prompt, params)
    while not any(moves) or spec.engine.scheduler.running[0].num_output_tokens < 16:
        spec.engine.step()
    req = spec.engine.scheduler.running[0]
    n = req.num_computed_tokens
    plain_llm = LLM(model=MODEL, progress=False, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=ROOMY_BYTES)
    plain_llm.engine.add_request("plain", req.all_token_ids[:n], SamplingParams(temperature=0.0, max_tokens=4))
    plain_llm.engine.step()  # the prefill of the same n tokens
    for got, want in zip(_kv(spec, "tree", n), _kv(plain_llm, "plain", n)):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # prefill vs decode rounding
