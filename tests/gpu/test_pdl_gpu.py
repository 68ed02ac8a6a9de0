"""Programmatic dependent launch (kernels/pdl.py): the decode path's Triton kernels launched
with PDL inside CUDA graphs give bitwise the tokens of ordinary launches. A kernel that read its
predecessor's output before `griddepcontrol.wait` would race and break this equality."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.kernels.pdl import use_pdl


def _run(path, monkeypatch, pdl: str, **kw) -> list:
    monkeypatch.setenv("SPECSERVE_PDL", pdl)
    llm = LLM(
        model=str(path),
        progress=False,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=8,
        kv_cache_memory_bytes=16 << 20,
        **kw,
    )
    assert llm.engine.runner.graphs is not None
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 300) for _ in range(rng.randint(3, 60))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    # One sequence alone: batch-1 decode, the GEMV path with split-KV attention.
    outs.append(llm.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0].token_ids)
    return outs


@pytest.mark.parametrize(
    "spec",
    [
        None,
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "adaptive": False,
        },
    ],
)
def test_pdl_launches_match_plain_launches(tiny_qwen2_dir, monkeypatch, device: torch.device, spec) -> None:
    if device.type != "cuda" or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU")
    monkeypatch.setenv("SPECSERVE_PDL", "1")
    assert use_pdl(torch.empty(1, device="cuda"))
    kw = {} if spec is None else {"speculative_config": spec}
    assert _run(tiny_qwen2_dir, monkeypatch, "1", **kw) == _run(tiny_qwen2_dir, monkeypatch, "0", **kw)
