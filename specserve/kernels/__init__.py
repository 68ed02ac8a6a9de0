"""Triton helpers shared by attention/ and model/: programmatic dependent launch (pdl.py) and RoPE
(rope.py). Importing a module here imports triton; this package imports no other specserve package
but envs."""
