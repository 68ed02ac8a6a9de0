"""--batch-invariant on the GPU: the Triton ops and paged attention at one launch shape give a
sequence's logits bit for bit alone and in batches of 3/8/17, as decode, verify or prefill, graph
padding included (bf16); end to end with CUDA graphs, greedy tokens and logprobs equal with and
without n-gram speculation, all prompts at once or one by one."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_batch_invariant_engine import _generate, _prompts
from tests.unit.test_batch_invariant import check_rows_invariant, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter is too slow here)")


def test_rows_are_batch_invariant_on_the_gpu():
    from specserve.attention.batch_invariant import triton_backend
    from specserve.model.layers import triton_ops

    model = tiny_model(True, torch.bfloat16, triton_ops, torch.device("cuda"))
    check_rows_invariant(model, triton_backend(), torch.bfloat16)


def test_greedy_same_with_and_without_speculation_on_the_gpu(tiny_llama_dir):
    from specserve import LLM

    common = dict(model=str(tiny_llama_dir), progress=False, batch_invariant=True, dtype="bfloat16")
    plain = LLM(**common, kv_cache_memory_bytes=64 << 20, max_num_seqs=16)
    assert plain.engine.runner.graphs is not None  # decode steps replay CUDA graphs
    together = _generate(plain, _prompts())
    assert [_generate(plain, [p])[0] for p in _prompts()] == together
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 3}
    spec = LLM(
        **common, kv_cache_memory_bytes=64 << 20, max_num_seqs=16, speculative_config={**ngram, "adaptive": False}
    )
    assert _generate(spec, _prompts()) == together
    assert spec.engine.stats.get("spec_decode_num_accepted_tokens_total") > 0
