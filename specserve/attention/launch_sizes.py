"""Paged-attention launch sizes, apart from the kernels so that planning code imports no triton."""

from __future__ import annotations

MAX_SPLITS = 128
SMALL_QUERY_MAX = 16  # query lengths up to this take decode-sized launches (attention_config)
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (partials, reduce) outweighs its work
