"""Triton helpers shared by attention/ and model/ (imports triton; no specserve package but envs)."""
