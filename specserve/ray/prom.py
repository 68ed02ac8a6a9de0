"""Merge the replicas' Prometheus pages into one, each series labelled `replica="i"`; samples are
grouped under their family's `# HELP` / `# TYPE` header (the first page's), as the format wants."""

from __future__ import annotations

import re
from collections.abc import Sequence

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?(\s+.*)$")


def label_sample(line: str, replica: str) -> str:
    """`name{a="b"} 1.0` -> `name{replica="0",a="b"} 1.0`."""
    m = _SAMPLE_RE.match(line)
    if m is None:
        return line
    name, labels, rest = m.groups()
    inner = f'replica="{replica}"' + (f",{labels}" if labels else "")
    return f"{name}{{{inner}}}{rest}"


def merge_metrics(pages: Sequence[tuple[str, str]]) -> str:
    """`pages`: (replica label, Prometheus text) pairs -> one Prometheus text."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in pages:
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    kept = headers.setdefault(family, [])
                    if len(kept) < 2 and line not in kept:
                        kept.append(line)
                continue
            samples.setdefault(family, []).append(label_sample(line, replica))
    out: list[str] = []
    for family in dict.fromkeys([*headers, *samples]):
        out += headers.get(family, [])
        out += samples.get(family, [])
    return "\n".join(out) + "\n"
