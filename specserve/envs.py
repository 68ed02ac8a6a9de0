"""The one place where specserve reads environment variables.

Every variable is read through a function, at call time (never at import), so tests can
monkeypatch the environment and see the change. Add new variables here, with their default and
meaning; other modules must not touch `os.environ` directly.

| variable          | default                          | meaning                                   |
| ----------------- | -------------------------------- | ----------------------------------------- |
| SPECSERVE_CACHE   | $XDG_CACHE_HOME/specserve        | models, converted tokenizers, temp files  |
|                   | (XDG_CACHE_HOME: ~/.cache)       |                                           |
| SPECSERVE_GEMV_MAX_M | 4 (model/layers/triton_gemv.py) | rows up to which linears use the Triton   |
|                   |                                  | GEMV on CUDA; 0 = always cuBLAS           |
| SPECSERVE_PDL     | 1 (model/layers/pdl.py)          | 0: no programmatic dependent launch for   |
|                   |                                  | the decode path's Triton kernels (Hopper+) |
| SPECSERVE_GEMV_PREFETCH | by K (model/layers/triton_gemv.py) | 1 / 0: the GEMV always / never requests |
|                   |                                  | its next weight tile one loop step ahead   |
| SPECSERVE_QKV_ROPE_FUSED | 0 (model/layers/triton_qkv_rope.py) | 1: decode-sized batches run the input |
|                   |                                  | norm, qkv, RoPE and the KV write as one   |
|                   |                                  | launch (Triton backend, unquantized KV)   |
| SPECSERVE_DEFER_DRAFTS | the proposer's (decoder.py) | 0: a proposal reads its drafts back at    |
|                   |                                  | its end instead of leaving them on the    |
|                   |                                  | device for the verify step; 1: deferred   |
|                   |                                  | for every proposer (A/B runs)             |
| SPECSERVE_PREFILL_PIECES | 1 (engine/engine.py)        | 0: short prompts run as one eager chunk   |
|                   |                                  | instead of prefill-graph pieces (A/B runs) |
| SPECSERVE_DRAFT_CHAIN_GRAPH | 0 (spec/draft_chain.py)  | 1: a draft model's chained steps of a     |
|                   |                                  | propose replay as one CUDA graph          |
| TRITON_INTERPRET  | unset                            | 1: Triton kernels run in its CPU          |
|                   |                                  | interpreter (kernel debugging, tests)     |
| SPECSERVE_API_KEY | unset (server/cli_args.py)       | the key `serve` requires when neither     |
|                   |                                  | --api-key nor --api-key-file is given     |
"""
from __future__ import annotations

import os
from pathlib import Path


def _get(name: str) -> str | None:
    """The variable's value, or None when unset or empty (an empty value means "use the default")."""
    value = os.environ.get(name)
    return value if value else None


def specserve_cache() -> Path:
    """Root of specserve's on-disk cache (SPECSERVE_CACHE, else $XDG_CACHE_HOME/specserve)."""
    explicit = _get("SPECSERVE_CACHE")
    if explicit is not None:
        return Path(explicit).expanduser()
    xdg = _get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg is not None else Path.home() / ".cache"
    return base / "specserve"


def gemv_max_m() -> int | None:
    """SPECSERVE_GEMV_MAX_M as an int >= 0, or None when unset (the module default applies)."""
    value = _get("SPECSERVE_GEMV_MAX_M")
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"SPECSERVE_GEMV_MAX_M must be a non-negative integer, got {value!r}.")
    return int(value)


def _switch(name: str) -> bool | None:
    """A 0 / 1 variable as a bool, None when unset; anything else is refused naming the variable."""
    value = _get(name)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}.")
    return value == "1"


def pdl() -> bool:
    """SPECSERVE_PDL: 1 (default) lets the Triton kernels of a decode step launch with programmatic
    dependent launch where the GPU has it; 0 turns it off (benchmarks compare)."""
    return _switch("SPECSERVE_PDL") is not False


def gemv_prefetch() -> bool | None:
    """SPECSERVE_GEMV_PREFETCH: 1 makes the GEMV request each weight tile one loop step ahead (the
    first before its PDL wait), 0 keeps the plain loop; None when unset (the GEMV decides by K)."""
    return _switch("SPECSERVE_GEMV_PREFETCH")


def skinny() -> bool:
    """SPECSERVE_SKINNY=0: never the tensor-core skinny GEMM (model/layers/triton_skinny.py), even
    where the tuned table picks it (A/B runs); default on."""
    return _switch("SPECSERVE_SKINNY") is not False


def attn_fused_reduce() -> bool:
    """SPECSERVE_ATTN_FUSED_REDUCE=1: the split-KV reduce inside the attention kernel (the last split
    program combines; attention/triton_paged.py). Default off: on the H200 it made a batch-1 decode
    step slower (1.5B 1.456 vs 1.406 ms, 8B 4.261 vs 4.183), its serial L2 round trips costing more
    than the reduce launch they save."""
    return _switch("SPECSERVE_ATTN_FUSED_REDUCE") is True


def attn_split_by_length() -> bool:
    """SPECSERVE_ATTN_SPLIT_BY_LENGTH=1: each q block of split-KV attention uses only the splits its own
    keys warrant (attention/triton_paged.py) instead of all of the launch's (a CUDA graph's are sized for
    max_model_len). Default off: on the H200 it made batch-1 decode of the 1.5B slower (1.334 against
    1.185 ms per step at max_model_len 32768, 1.311 against 1.178 at 4096): fewer splits leave too few
    programs for a short context, and the empty splits cost little."""
    return _switch("SPECSERVE_ATTN_SPLIT_BY_LENGTH") is True


def qkv_rope_fused() -> bool:
    """SPECSERVE_QKV_ROPE_FUSED=1: a decoder layer's input norm + qkv GEMV also applies RoPE and writes
    K/V into the paged cache (model/layers/triton_qkv_rope.py), one launch fewer per layer at decode
    sizes. Default off until it is measured on the H200."""
    return _switch("SPECSERVE_QKV_ROPE_FUSED") is True


def defer_drafts() -> bool | None:
    """SPECSERVE_DEFER_DRAFTS: 0, proposers read their drafts back at the end of a proposal, as before
    spec/draft_tokens.py DeferredDrafts; 1, every proposer defers them (A/B runs); unset (None), each
    proposer's own default (DraftDelivery.defers_by_default). Off anyway with tensor parallelism."""
    return _switch("SPECSERVE_DEFER_DRAFTS")


def prefill_pieces() -> bool:
    """SPECSERVE_PREFILL_PIECES=0: a short prompt at low load runs as one eager chunk instead of pieces
    that replay captured prefill graphs (scheduler/scheduler.py prefill_piece; A/B runs). Default on."""
    return _switch("SPECSERVE_PREFILL_PIECES") is not False


def prefill_apart() -> bool:
    """SPECSERVE_PREFILL_APART=1: beside a decoding batch of more than two requests, a new request's short
    prompt runs in prefill-graph pieces in steps of its own instead of one eager step with the whole batch
    (scheduler/scheduler.py prefill_apart). Default off until it is measured on the H200."""
    return _switch("SPECSERVE_PREFILL_APART") is True


def catch_up_graphs() -> bool:
    """SPECSERVE_CATCH_UP_GRAPHS=0: a draft model captures prefill graphs of one or two sequences for
    its catch-ups, as before the catch-up graphs of up to 32 (runner/cuda_graph.py CATCH_UP_QUERY_LENS;
    A/B runs). Default on."""
    return _switch("SPECSERVE_CATCH_UP_GRAPHS") is not False


def mixed_graphs() -> bool:
    """SPECSERVE_MIXED_GRAPHS=0: ragged steps (a prompt chunk beside decoding requests) run eagerly, as
    before the target's mixed CUDA graphs (runner/cuda_graph.py MIXED_TOKEN_LENS; A/B runs). Default on."""
    return _switch("SPECSERVE_MIXED_GRAPHS") is not False


def draft_chain_graph() -> bool:
    """SPECSERVE_DRAFT_CHAIN_GRAPH=1: a draft model's greedy chained steps of a propose run as one CUDA
    graph (spec/draft_chain.py; eagerly on the CPU). Default off until it is measured on the H200."""
    return _switch("SPECSERVE_DRAFT_CHAIN_GRAPH") is True


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors through Triton's interpreter."""
    return _get("TRITON_INTERPRET") == "1"


def api_key() -> str | None:
    """SPECSERVE_API_KEY: the API key of `specserve serve` (and the key `bench` / `advise` send)
    when none is given on the command line; an environment variable stays out of `ps`."""
    return _get("SPECSERVE_API_KEY")
