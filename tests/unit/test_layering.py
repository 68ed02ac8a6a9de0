"""Package boundaries of specserve, read from the source with `ast` (every import, those inside
functions included): the top-level packages form layers and import only downwards, no package
imports another's private (`_name`) names, `distributed` does not import `server`, and the engine
core imports no web framework."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "specserve"

# Lowest first. A package may import packages of lower layers only; within the front ends (the last
# layer) imports are free as long as they form no cycle. Every top-level package or module of
# specserve must be listed, so a new one gets a place on purpose.
LAYERS: list[tuple[str, ...]] = [
    ("envs", "config", "outputs", "metrics"),
    ("sampling_params",),
    ("kernels",),
    ("kv",),
    ("attention",),
    ("model",),
    ("scheduler",),
    ("sample",),
    ("runner",),
    ("distributed",),
    ("speculative",),
    ("engine",),
    ("__init__", "llm", "train", "server", "bench", "ray"),
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
FRONT_ENDS = set(LAYERS[-1])
ENGINE_CORE = {
    "config",
    "sampling_params",
    "metrics",
    "kernels",
    "kv",
    "attention",
    "model",
    "scheduler",
    "sample",
    "runner",
    "distributed",
    "speculative",
    "engine",
}
WEB = {"fastapi", "uvicorn", "pydantic", "starlette"}


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _top_level_names() -> set[str]:
    return {
        p.name if p.is_dir() else p.stem
        for p in ROOT.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py")
    }


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in the file."""
    rel = path.relative_to(ROOT.parent).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against the file's package
                base = rel[: len(rel) - node.level]
                module = ".".join(base) + (f".{module}" if module else "")
            out.append((node.lineno, module, [alias.name for alias in node.names]))
    return out


def _scan() -> tuple[dict[tuple[str, str], list[str]], list[str], dict[str, set[str]]]:
    """(package edges -> where, private cross-package imports, third-party top modules per package)."""
    top = _top_level_names()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    private: list[str] = []
    external: dict[str, set[str]] = defaultdict(set)
    for path in sorted(ROOT.rglob("*.py")):
        src = _package_of(path)
        where = f"{path.relative_to(ROOT.parent)}"
        for line, module, names in _imports(path):
            parts = module.split(".")
            if parts[0] != "specserve":
                external[src].add(parts[0])
                continue
            if len(parts) == 1:  # from specserve import X: a submodule, or a name of specserve/__init__
                targets = [n if n in top else "__init__" for n in names]
            else:
                targets = [parts[1]]
            for dst in targets:
                if dst != src:
                    edges[(src, dst)].append(f"{where}:{line}")
            if len(parts) > 1 and parts[1] != src:
                private += [f"{where}:{line} {module}.{n}" for n in names if n.startswith("_")]
                private += [f"{where}:{line} {module}" for p in parts[2:] if p.startswith("_") and p != "__init__"]
    return edges, private, external


EDGES, PRIVATE, EXTERNAL = _scan()


def _cycle(edges: dict[tuple[str, str], list[str]]) -> list[str] | None:
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_every_package_has_a_layer() -> None:
    unknown = sorted(_top_level_names() - set(RANK))
    assert not unknown, f"place these in LAYERS: {unknown}"


def test_no_import_cycle_between_packages() -> None:
    cycle = _cycle(EDGES)
    assert cycle is None, (
        " -> ".join(cycle or [])
        + "\n"
        + "\n".join(f"{a} -> {b}: {EDGES[(a, b)][0]}" for a, b in zip(cycle or [], (cycle or [])[1:]))
    )


def test_imports_go_down_the_layers() -> None:
    upward = [
        f"{a} -> {b} ({', '.join(locs[:3])})"
        for (a, b), locs in sorted(EDGES.items())
        if a in RANK and b in RANK and RANK[b] >= RANK[a] and not (a in FRONT_ENDS and b in FRONT_ENDS)
    ]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_private_names_across_packages() -> None:
    assert not PRIVATE, "private names imported from another package:\n" + "\n".join(PRIVATE)


def test_distributed_does_not_import_server() -> None:
    assert ("distributed", "server") not in EDGES, EDGES.get(("distributed", "server"))


@pytest.mark.parametrize("package", sorted(ENGINE_CORE))
def test_engine_core_imports_no_web_framework(package: str) -> None:
    assert not EXTERNAL.get(package, set()) & WEB


def test_the_scan_sees_imports_inside_functions() -> None:
    # engine/setup.py imports the tensor-parallel executor inside build_engine_parts only
    assert ("engine", "distributed") in EDGES
    assert ("runner", "model") in EDGES and ("model", "runner") not in EDGES
