"""SPECSERVE_PDL parsing and where programmatic dependent launch may be used (model/layers/pdl.py)."""
from __future__ import annotations

import pytest
import torch

from specserve import envs
from specserve.model.layers.pdl import use_pdl


def test_pdl_variable(monkeypatch) -> None:
    monkeypatch.delenv("SPECSERVE_PDL", raising=False)
    assert envs.pdl() is True
    monkeypatch.setenv("SPECSERVE_PDL", "0")
    assert envs.pdl() is False
    monkeypatch.setenv("SPECSERVE_PDL", "yes")
    with pytest.raises(ValueError, match="SPECSERVE_PDL"):
        envs.pdl()


def test_never_on_cpu_tensors(monkeypatch) -> None:
    monkeypatch.setenv("SPECSERVE_PDL", "1")
    assert use_pdl(torch.zeros(2)) is False


def test_gemv_prefetch_rule(monkeypatch) -> None:
    """Short reductions only by default (measured: it helps K = 1536, costs K = 4096 and more);
    SPECSERVE_GEMV_PREFETCH forces it either way and refuses other values."""
    from specserve.model.layers import triton_gemv

    monkeypatch.delenv("SPECSERVE_GEMV_PREFETCH", raising=False)
    assert triton_gemv._prefetch(1536) and triton_gemv._prefetch(triton_gemv.PREFETCH_MAX_K)
    assert not triton_gemv._prefetch(4096)
    monkeypatch.setenv("SPECSERVE_GEMV_PREFETCH", "1")
    assert triton_gemv._prefetch(14336)
    monkeypatch.setenv("SPECSERVE_GEMV_PREFETCH", "0")
    assert not triton_gemv._prefetch(1536)
    monkeypatch.setenv("SPECSERVE_GEMV_PREFETCH", "2")
    with pytest.raises(ValueError, match="SPECSERVE_GEMV_PREFETCH"):
        triton_gemv._prefetch(1536)
