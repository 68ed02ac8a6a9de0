"""The one place where specserve reads environment variables, each through a function at call time.
SPECSERVE_CACHE, SPECSERVE_GEMV_MAX_M, SPECSERVE_PDL, TRITON_INTERPRET, SPECSERVE_API_KEY."""

from __future__ import annotations

import os
from pathlib import Path


def _get(name: str) -> str | None:
    """The variable's value, or None when unset or empty (an empty value means "use the default")."""
    value = os.environ.get(name)
    return value if value else None


def specserve_cache() -> Path:
    """Root of specserve's on-disk cache (SPECSERVE_CACHE, else $XDG_CACHE_HOME/specserve)."""
    if explicit := _get("SPECSERVE_CACHE"):
        return Path(explicit).expanduser()
    return Path(_get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "specserve"


def gemv_max_m() -> int | None:
    """SPECSERVE_GEMV_MAX_M as an int >= 0, or None when unset (the module default applies)."""
    value = _get("SPECSERVE_GEMV_MAX_M")
    if value is not None and not value.isdigit():
        raise ValueError(f"SPECSERVE_GEMV_MAX_M must be a non-negative integer, got {value!r}.")
    return None if value is None else int(value)


def pdl() -> bool:
    """SPECSERVE_PDL: 1 (default) = programmatic dependent launch for the decode path's kernels; 0 = off."""
    value = _get("SPECSERVE_PDL")
    if value is not None and value not in ("0", "1"):
        raise ValueError(f"SPECSERVE_PDL must be 0 or 1, got {value!r}.")
    return value != "0"


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors through Triton's interpreter."""
    return _get("TRITON_INTERPRET") == "1"


def api_key() -> str | None:
    """SPECSERVE_API_KEY: the key of `serve` (and of `bench` / `advise`) when no flag gives one."""
    return _get("SPECSERVE_API_KEY")
