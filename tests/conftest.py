"""Shared fixtures: tiny random-weight models built once per session."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_model_dir

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=2, num_heads=4, num_kv_heads=1)


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    from specserve import LLM

    return LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
