"""Sizes that decide the paged-attention launches (attention/triton_paged.py), kept apart from the
kernels so that code that only plans launches (runner/warmup.py) imports no triton: a CPU install
without triton must still import specserve."""

from __future__ import annotations

MAX_SPLITS = 128
SMALL_QUERY_MAX = 16  # query lengths up to this take decode-sized launches (attention_config)
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (partials, reduce) outweighs its work
