"""A bench's A/B switch: an environment variable set while an engine (or a kernel) is built."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def env_set(name: str, value: str | None) -> Iterator[None]:
    """`name`=value while the block runs, restored after; value None leaves it as it is."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
