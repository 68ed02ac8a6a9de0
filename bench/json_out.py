"""A result JSON rewritten atomically (a temporary beside it, then a rename), so a run cut short
leaves the last complete file: bench/spec_bench.py and bench/controller_sweep.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any, tmp_suffix: str = ".tmp") -> None:
    """json.dumps(indent=1, default=str) into `path` via path.with_suffix(tmp_suffix)."""
    tmp = path.with_suffix(tmp_suffix)
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
