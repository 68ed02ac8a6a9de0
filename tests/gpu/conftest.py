"""GPU kernel tests (Triton). They run on the H200 that GPU work is checked on (shared/GPU.md).

Where CUDA or Triton is missing (the CPU CI machines) every test in this directory is skipped with
a reason, on purpose: these tests exercise Triton kernels, which only run on a GPU, and the CPU
suite covers the torch twins. The modules import triton lazily, so collection never fails.

With triton installed and TRITON_INTERPRET=1 they also run on the CPU through Triton's own
interpreter (slow, small shapes; for debugging kernels with no GPU at hand). Three gaps of the
triton 3.6 interpreter are patched for that mode only (see `_patch_interpreter`). Use triton 3.6 (the
H200 image's; `pip install triton==3.6.0`): triton 3.9's interpreter, which xgrammar may pull in,
refuses a block mask combined with a scalar condition ("mask has unsupported dtype").
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _unavailable_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (GPU kernel tests run on the H200)"
    if not torch.cuda.is_available() and not _interpreting():
        return "no CUDA device (GPU kernel tests run on the H200; TRITON_INTERPRET=1 runs them on the CPU)"
    return None


def _patch_interpreter() -> None:
    """Make Triton's CPU interpreter compute what the GPU computes (triton 3.6, numpy >= 2.4):
    it rounds fp32 -> bf16 toward zero (the GPU: to nearest even), multiplies bf16 dot operands as
    their uint16 storage, and calls int() on 1-element arrays, which numpy now refuses."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    convert, patch_tensor, dot = interp._convert_float, interp._patch_lang_tensor, interp.InterpreterBuilder.create_dot

    def convert_float(data, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return convert(data, src, dst, rounding)

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        raw = torch.from_numpy(np.ascontiguousarray(h.data).view(np.int16).copy())
        return interp.TensorHandle(raw.view(torch.bfloat16).float().numpy(), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._convert_float = convert_float
    interp._patch_lang_tensor = patch_lang_tensor
    interp.InterpreterBuilder.create_dot = create_dot


def pytest_configure(config: pytest.Config) -> None:
    if _interpreting() and _unavailable_reason() is None:
        _patch_interpreter()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu" if _interpreting() else "cuda")


@pytest.fixture
def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter: tests shrink their shapes."""
    return _interpreting()
