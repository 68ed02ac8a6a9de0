"""Name a first-use stall's kernel: every Triton JIT compile from the moment this is installed is
reported (Triton's jit_cache_hook runs before each), with the kernel's name, its constexprs (integer
arguments equal to 1 among them) and which arguments Triton specialized as divisible by 16: a variant
no start-up forward compiled differs from them in one of these."""
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
        report(describe(getattr(fn, "name", fn), compile))
        return False  # compile as usual

    knobs.runtime.jit_cache_hook = hook
    return True


def describe(name: str, compile: dict[str, Any]) -> str:
    """"name {constexprs} div16=[argument indices]" from the compile dict Triton passes its hook."""
    attrs = (compile.get("configs") or [{}])[0] or {}
    div16 = sorted(idx[0] for idx, specs in attrs.items() if any(spec[0] == "tt.divisibility" for spec in specs))
    return f"{name} {dict(compile.get('constants', {}))} div16={div16}"
