"""Tensor parallelism: process groups, the rank-0 executor, the worker loop.

Imported only when tensor_parallel_size > 1. See docs/scaling.md for the layout and for going
past one machine.
"""
