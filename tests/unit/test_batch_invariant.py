"""Batch-invariant mode (--batch-invariant) on the torch path: a sequence's logits are bit-identical
whether it runs alone or beside 2, 7 or 16 random sequences, and whether its last token arrives as a
decode step, a spec-verify block or part of a prefill. The plain float32 path is shown to differ."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.attention.base import ForwardContext, forward_context
from specserve.attention.batch_invariant import BatchInvariantTorchBackend
from specserve.attention.torch_ref import TorchRefBackend
from specserve.kv.spec import KVCacheSpec, kv_format
from specserve.model.arch import ModelArch, rope_cos_sin_cache
from specserve.model.layers import ops as torch_ops
from specserve.model.layers.batch_invariant import make_ops
from specserve.model.llama import CausalLM
from tests.helpers.attention_meta import paged_metadata

HF = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 300,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
}
BLOCK, BLOCKS_PER_SEQ = 16, 8
TARGET = [random.Random(0).randrange(300) for _ in range(70)]  # 70 tokens: keys span two KV tiles


@pytest.fixture(autouse=True)
def _one_thread():
    """Many tiny GEMMs: one thread avoids the spin-waits that make them slow on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CPU = torch.device("cpu")


def tiny_model(invariant: bool, dtype: torch.dtype, base=torch_ops, device: torch.device = CPU) -> CausalLM:
    """Random weights; base: the layer ops (ops.py or triton_ops.py), made batch-invariant if asked."""
    arch = ModelArch.from_hf_config(HF)
    torch.manual_seed(0)
    model = CausalLM(arch, rope_cos_sin_cache(arch, 256, CPU), make_ops(base) if invariant else base)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.1)
            p.data = p.data.to(dtype)
    return model.to(device).eval()


@torch.no_grad()
def _run(
    model: CausalLM, backend, steps: list[list[tuple[int, list[int]]]], dtype: torch.dtype, pad: int = 0
) -> dict[int, torch.Tensor]:
    """Run the steps (each: (sequence id, its new tokens) in batch order) over fresh caches, the last
    one padded as a CUDA-graph replay pads (`pad` tokens at slot -1 and `pad` empty sequences);
    returns the last step's logits [new tokens, vocab] per sequence id."""
    a = model.arch
    spec = KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, BLOCK, kv_format("auto", dtype))
    device = model.cos_sin_cache.device
    caches = spec.allocate(BLOCKS_PER_SEQ * 20, device)
    lengths: dict[int, int] = {}
    for step in steps:
        specs = [(lengths.get(s, 0), len(toks)) for s, toks in step]
        # Blocks from the top for sequence 0, so the target's block ids vary with the batch around it.
        tables = [[(19 - s) * BLOCKS_PER_SEQ + i for i in range(BLOCKS_PER_SEQ)] for s, _ in step]
        n_pad = pad if step is steps[-1] else 0
        meta = paged_metadata(specs, tables, BLOCK, device, pad_tokens=n_pad, pad_seqs=n_pad)
        ids = torch.tensor([t for _, toks in step for t in toks] + [7] * n_pad, device=device)
        positions = torch.tensor([c + i for c, n in specs for i in range(n)] + [0] * n_pad, device=device)
        with forward_context(ForwardContext(meta, caches, spec.fmt, backend)):
            logits = model.compute_logits(model(ids, positions))
        out, start = {}, 0
        for s, toks in step:
            out[s] = logits[start : start + len(toks)]
            start += len(toks)
            lengths[s] = lengths.get(s, 0) + len(toks)
    return out


def _scenarios(batch: int) -> dict[str, list[list[tuple[int, list[int]]]]]:
    """The target (id 0) ends at TARGET[-1] as decode / verify (4 tokens) / prefill, beside batch - 1
    random sequences whose last step is a decode, a verify or a whole prefill; the target sits mid-batch."""
    rng = random.Random(batch)
    others = [[rng.randrange(300) for _ in range(rng.randrange(2, 90))] for _ in range(batch - 1)]
    cuts = [rng.choice((1, 4, len(o))) for o in others]
    out = {}
    for name, q in (("decode", 1), ("verify", 4), ("prefill", len(TARGET))):
        first = [(i + 1, o[:-c]) for i, (o, c) in enumerate(zip(others, cuts)) if len(o) > c]
        first += [(0, TARGET[:-q])] if q < len(TARGET) else []
        last = [(i + 1, o[-c:]) for i, (o, c) in enumerate(zip(others, cuts))]
        last.insert(len(last) // 2, (0, TARGET[-q:]))
        out[name] = [first, last] if first else [last]
    return out


def _reference(model: CausalLM, backend, dtype: torch.dtype) -> torch.Tensor:
    return _run(model, backend, [[(0, TARGET[:-1])], [(0, TARGET[-1:])]], dtype)[0][-1]


def check_rows_invariant(model: CausalLM, backend, dtype: torch.dtype) -> None:
    """The target's last row, alone as a decode step, equals it in every scenario, bit for bit."""
    ref = _reference(model, backend, dtype)
    for batch in (1, 3, 8, 17):
        for name, steps in _scenarios(batch).items():
            for pad in (0, 5):
                got = _run(model, backend, steps, dtype, pad)[0][-1]
                assert torch.equal(got, ref), f"batch {batch}, {name}, pad {pad}: {(got - ref).abs().max().item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant_in_the_mode(dtype):
    check_rows_invariant(tiny_model(True, dtype), BatchInvariantTorchBackend(), dtype)


@pytest.mark.parametrize("invariant_ops, invariant_attention", [(False, False), (True, False), (False, True)])
def test_the_check_fails_without_the_whole_mode(invariant_ops, invariant_attention):
    """In float32 on the CPU the default ops and the default attention each round differently by
    batch and query shape (in bfloat16 the plain CPU path happens to be invariant for this model)."""
    model = tiny_model(invariant_ops, torch.float32)
    backend = BatchInvariantTorchBackend() if invariant_attention else TorchRefBackend()
    ref = _reference(model, backend, torch.float32)
    diffs = [
        not torch.equal(_run(model, backend, steps, torch.float32)[0][-1], ref)
        for batch in (3, 17)
        for steps in _scenarios(batch).values()
    ]
    assert any(diffs)


def test_flag_and_config():
    """`--batch-invariant` reaches the engine config; tensor parallelism is refused (all-reduce order)."""
    import argparse

    from specserve.config import EngineConfig
    from specserve.server.cli_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kw = engine_kwargs(parser.parse_args(["tiny", "--batch-invariant"]))
    assert EngineConfig.from_kwargs(**kw).model.batch_invariant
    assert not EngineConfig().model.batch_invariant
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs(batch_invariant=True, tensor_parallel_size=2)
