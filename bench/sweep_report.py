"""bench/controller_sweep.py's output: the per-mode JSON (rewritten after every point), the
markdown tables (controller_sweep.md) and PNGs (bench/plot_sweep.py), the commit it ran at."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def _load_bench(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


json_out = _load_bench("json_out")  # write_json_atomic (shared with spec_bench)
plot_sweep = _load_bench("plot_sweep")  # markdown tables (and PNGs with --plots)


class Writer:
    """The mode's JSON, rewritten (atomically) after every point."""

    def __init__(self, out_dir: Path, name: str, result: dict[str, Any]) -> None:
        self.path = out_dir / f"controller_sweep_{name}.json"
        self.result = result

    def write(self) -> None:
        json_out.write_json_atomic(self.path, self.result, ".json.tmp")


def mark_failed(out_dir: Path, name: str, e: BaseException) -> dict[str, Any] | None:
    """A failed mode's JSON (the points measured before) with its error added; None if it wrote none."""
    path = out_dir / f"controller_sweep_{name}.json"
    if not path.is_file():
        return None
    partial = json.loads(path.read_text())
    partial["error"] = repr(e)
    path.write_text(json.dumps(partial, indent=1, default=str))
    return partial


def write_tables(results: list[dict[str, Any]], out_dir: Path, plots: bool) -> None:
    """controller_sweep.md (printed too) and, with `plots`, the PNGs."""
    tables = "\n\n".join(plot_sweep.markdown_tables(r) for r in results)
    (out_dir / "controller_sweep.md").write_text(tables + "\n")
    print("\n" + tables)
    if plots:
        try:
            for r in results:
                for path in plot_sweep.plot_result(r, out_dir):
                    print(f"plot: {path}")
        except Exception as e:  # noqa: BLE001 (plots are a convenience: the JSON is the result)
            print(f"plots failed: {e!r}")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_HERE.parent, capture_output=True, text=True,
                             check=False)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=_HERE.parent, capture_output=True, text=True,
                               check=False)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except OSError:
        return None
