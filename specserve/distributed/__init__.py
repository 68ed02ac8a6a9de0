"""Tensor parallelism: process groups, the rank-0 executor, the worker loop (tensor_parallel_size > 1)."""
