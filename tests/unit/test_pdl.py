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
