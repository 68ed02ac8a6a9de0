"""Find the processes of one Ray instance, told apart by the RAY_TMPDIR it was started with."""

from __future__ import annotations

import os
from pathlib import Path


def ray_processes(tmpdir: str) -> list[int]:
    """Pids of live processes (not this one) whose command line or environment names `tmpdir`:
    raylet and gcs_server carry it in their arguments, workers (which retitle themselves) in the
    RAY_TMPDIR they inherit."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            seen = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
            state = next((ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if tmpdir.encode() in seen and "zombie" not in state:
            pids.append(int(entry.name))
    return pids
