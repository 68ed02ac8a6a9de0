"""The EAGLE head's forwards as CUDA graphs on the GPU (the first forward of a propose,
speculative/proposers/eagle_first.py, and the draft steps, speculative/proposers/eagle_graph.py;
eagle, eagle3 and P-EAGLE): the same
tokens as plain decoding and the same proposals as the eager head and as the static buffers
without capture, over batches that need padding and requests that finish at different times."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.speculative.proposers.eagle import EagleProposer
from specserve.speculative.proposers.eagle_first import MAX_GRAPH_PICKS
from tests.helpers.eagle_heads import make_random_head_dir

K = 3


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _run(target: str, spec: dict | None, mode: str, prompts, params, monkeypatch):
    """(outputs, proposals, llm); proposals: (prompt, tokens so far) -> (drafts, draft probs)."""
    monkeypatch.setattr(EagleProposer, "step_graphs", mode)
    llm = LLM(
        model=target,
        progress=False,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=8 << 20,
        enable_prefix_caching=False,
        speculative_config=spec,
    )
    proposals: dict = {}
    if spec is not None:
        proposer = llm.engine.spec.proposer
        propose = proposer.propose

        def recording(inp):
            propose(inp)
            proposer.resolve_deferred()  # drafts left on the device for the verify step: read them now
            for r in inp.requests:  # keyed by request and length: runs may diverge after a flipped draft
                proposals[(tuple(r.prompt_token_ids), r.num_tokens)] = (list(r.spec_token_ids), r.spec_draft_probs)

        proposer.propose = recording
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.kv.check_integrity()
    assert llm.engine.num_blocks_in_use() == 0
    assert llm.engine.runner.graphs is not None
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], proposals, llm


def _agreement(a: dict, b: dict) -> float:
    """Share of the proposals both runs made (same request, same length) with the same drafts
    (and draft distributions within float noise)."""
    both = a.keys() & b.keys()
    assert len(both) >= 0.5 * max(len(a), len(b)) > 0
    same = 0
    for key in both:
        (da, qa), (db, qb) = a[key], b[key]
        same += (
            da == db and (qa is None) == (qb is None) and (qa is None or torch.allclose(qa, qb, rtol=1e-4, atol=1e-5))
        )
    return same / len(both)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "p-eagle"])
def test_graph_steps_equal_eager(tiny_llama_dir, tmp_path, method, sampling, device: torch.device, monkeypatch) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    target = str(tiny_llama_dir)
    parallel = method == "p-eagle"
    head = "eagle3" if parallel else method
    spec = {
        "method": head,
        "num_speculative_tokens": K,
        "adaptive": False,
        "parallel_drafting": parallel,
        "model": str(make_random_head_dir(target, tmp_path / "h", head, num_mask_slots=K - 1 if parallel else 0)),
    }
    prompts = _prompts(7, seed=4)  # 7 requests -> padded to 8, fewer as they finish
    if sampling == "greedy":
        params = [SamplingParams(temperature=0.0, max_tokens=5 + 4 * i, ignore_eos=True) for i in range(7)]
    else:
        params = [
            SamplingParams(
                temperature=0.0 if i % 3 == 0 else 0.8 + 0.1 * i,
                seed=100 + i,
                top_k=30 if i % 2 else 0,
                max_tokens=5 + 4 * i,
                ignore_eos=True,
            )
            for i in range(7)
        ]
    graphed, graph_props, llm = _run(target, spec, "auto", prompts, params, monkeypatch)
    proposer, sizes = llm.engine.spec.proposer, sorted(llm.engine.runner.graphs.batch_sizes)
    first = proposer.first  # captured per size, up to MAX_GRAPH_PICKS picks
    assert sorted(first.graphs) == [b for b in sizes if b * first.picks_per_req <= MAX_GRAPH_PICKS]
    assert first.runs[8] > 0 and first.runs[4] > 0
    if parallel:
        assert proposer.steps is None
    else:
        steps = proposer.steps
        assert sorted(steps.graphs) == sizes
        assert steps.runs[8] > 0 and steps.runs[4] > 0 and steps.dead_rows > 0
    static, static_props, _ = _run(target, spec, "static", prompts, params, monkeypatch)
    eager, eager_props, eager_llm = _run(target, spec, "eager", prompts, params, monkeypatch)
    assert eager_llm.engine.spec.proposer.steps is None and eager_llm.engine.spec.proposer.first is None
    if sampling == "greedy":
        plain, _, _ = _run(target, None, "auto", prompts, params, monkeypatch)
        assert graphed == plain
    # A replay runs the kernels the static path launches. The eager head batches only the rows still
    # drafting and picks Triton's split-KV factor from the true lengths, so its floats may differ in
    # the last bits: a draft can flip on a near-tie (the output stays exact), rarely.
    agree_static, agree_eager = _agreement(graph_props, static_props), _agreement(graph_props, eager_props)
    assert agree_static >= 0.95 and agree_eager >= 0.9, (agree_static, agree_eager)
    if sampling == "greedy":
        assert graphed == static == eager
    elif agree_static == 1.0 and len(graph_props) == len(static_props):
        assert graphed == static  # same drafts, same generator streams: the same samples
