"""Name a first-use stall's kernel: every Triton JIT compile from the moment this is installed is
reported (Triton's jit_cache_hook runs before each), with the kernel's name and constexprs."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def log_compiles(report: Callable[[str], None]) -> bool:
    """Call report("kernel {constexprs}") before every Triton compile from now on; False where Triton
    is not installed (a CPU install: nothing compiles)."""
    try:
        from triton import knobs
    except ImportError:
        return False

    def hook(key: Any, repr: str, fn: Any, compile: dict[str, Any], **_: Any) -> bool:  # noqa: A002 (Triton's names)
        report(f"{getattr(fn, 'name', fn)} {dict(compile.get('constants', {}))}")
        return False  # compile as usual

    knobs.runtime.jit_cache_hook = hook
    return True
