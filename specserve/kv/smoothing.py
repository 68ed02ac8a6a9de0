"""Static per-channel key smoothing for the rotated nvfp4 KV cache (fmt.rotate).

A few key channels (post-RoPE) carry outliers; 4-bit groups that hold one lose the small channels
around it. Per layer and KV head, a static factor s [num_kv_heads, head_dim] (powers of two) is
calibrated once at start-up; keys are cached as rotate(k / s) and queries meet them as rotate(q * s),
so q.k is unchanged (scaling by powers of two is exact) while the cached values lose their outliers.
s_c = 2^round(log2(sqrt(absmax_c(k) / absmax_c(q)))) (SmoothQuant's balance of the two sides,
alpha 1/2), centred to geometric mean 1 per head, from one forward of CALIBRATION_TEXT. The factors
depend on the weights only, so a prefix stores the same bytes in every process of the same model;
they must be installed before any KV is written (cached blocks and prefix caching share them).
"""

from __future__ import annotations

import hashlib
import math

import torch

from specserve.kv.spec import LayerKVCache

# Prose, code and chat-like text: a few hundred tokens, enough for every channel's range.
CALIBRATION_TEXT = """The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers
that changed physics: on the photoelectric effect, Brownian motion, special relativity and mass-energy.
User: What is the capital of France?
Assistant: The capital of France is Paris, a city of about two million people on the Seine.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]

for i, value in enumerate(fibonacci(10)):
    print(f"{i:3d}: {value}")

Here are three tips for staying focused: remove distractions, work in short blocks with breaks,
and write down what you want to finish before you start. The sky is blue because air molecules
scatter short (blue) wavelengths of sunlight much more strongly than long (red) ones.
{"name": "specserve", "version": 3, "tags": ["inference", "llm", "kv-cache"], "ok": true}
SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY name LIMIT 10;
"""
MAX_CALIBRATION_TOKENS = 512
_FALLBACK_SEED = 0  # a model without a tokenizer calibrates on seeded random token ids
_MAX_LOG2 = 8  # factors within 2^-8 .. 2^8


def smoothing_factors(key_absmax: torch.Tensor, query_absmax: torch.Tensor) -> torch.Tensor:
    """key_absmax, query_absmax [..., H, D] (a query channel: its max over the head's GQA group) ->
    s [..., H, D] float32, powers of two, geometric mean (before rounding) 1 per head."""
    tiny = torch.finfo(torch.float32).tiny
    log_s = 0.5 * (key_absmax.float().clamp_min(tiny).log2() - query_absmax.float().clamp_min(tiny).log2())
    log_s = log_s - log_s.mean(dim=-1, keepdim=True)
    return torch.exp2(log_s.round().clamp(-_MAX_LOG2, _MAX_LOG2))


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """The token ids calibration runs on (at most MAX_CALIBRATION_TOKENS)."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(_FALLBACK_SEED)
        return torch.randint(0, vocab_size, (MAX_CALIBRATION_TOKENS // 2,), generator=gen).tolist()
    return list(tokenizer.encode(CALIBRATION_TEXT))[:MAX_CALIBRATION_TOKENS]


def with_key_smoothing(caches: list[LayerKVCache], factors: torch.Tensor) -> list[LayerKVCache]:
    """The caches with their layer's factors [num_layers, H, D] attached (before any KV is written)."""
    if factors.shape[0] != len(caches) or not math.prod(factors.shape):
        raise ValueError(f"{factors.shape[0]} layers of smoothing factors for {len(caches)} caches")
    return [c._replace(key_smooth=factors[i].to(c.key.device).contiguous()) for i, c in enumerate(caches)]


def smoothing_tag(caches: list[LayerKVCache]) -> str:
    """ "" without key smoothing, else "|ks" and a digest of every layer's factors: persisted KV (the disk
    tier's namespace) is only read back by a pool with the same factors."""
    factors = [c.key_smooth for c in caches if c.key_smooth is not None]
    if not factors:
        return ""
    digest = hashlib.sha256(b"".join(f.detach().float().cpu().numpy().tobytes() for f in factors))
    return "|ks" + digest.hexdigest()[:16]
