"""Shared pieces of the KV quality / tier benchmarks (kv_quality.py, humaneval_kv.py, tier_ttft.py).

Logging with timestamps, a time budget, one model load shared by every LLM built in a process,
held-out stdlib text, a generate loop that stops at a deadline, JSON output and markdown tables.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.outputs import RequestOutput  # noqa: E402

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
_T0 = time.monotonic()

# Held-out text for perplexity: stdlib files the draft-head training data never reads.
# specserve/spec/train_data.py skips every file under these folders (its _SKIP_DIRS), so all of
# Lib/test, Lib/turtledemo and Lib/lib2to3 are unseen by it; the explicit list comes first so the
# token set is the same on every machine with that Python, the globs fill up when it runs short.
HELD_OUT_FILES = ("test/test_textwrap.py", "test/test_statistics.py", "test/test_heapq.py",
                  "test/test_bisect.py", "test/test_fractions.py", "test/test_shlex.py")
HELD_OUT_GLOBS = ("turtledemo/*.py", "lib2to3/*.py", "test/test_*.py")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


class Budget:
    """A wall-clock deadline (None: no limit); `sub(f)` is a deadline for a fraction f of what is left."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def expired(self, margin_s: float = 0.0) -> bool:
        return self.left() <= margin_s

    def sub(self, fraction: float) -> "Budget":
        out = Budget(None)
        if self.deadline is not None:
            out.deadline = time.monotonic() + max(0.0, self.left()) * fraction
        return out


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def shared_models() -> Iterator[dict]:
    """Every LLM built inside shares loaded weights (same model, dtype, max_model_len, device):
    the GGUF is dequantized once per process, not once per configuration."""
    import specserve.runner.build as setup

    cache: dict[tuple, Any] = {}
    original = setup.load_model

    def cached(cfg, device, dtype, *args, **kwargs):
        key = (cfg.model, str(dtype), cfg.max_model_len, str(device), cfg.load_format)
        if key not in cache:
            t = time.monotonic()
            cache[key] = original(cfg, device, dtype, *args, **kwargs)
            log(f"loaded {cfg.model} ({dtype}) in {time.monotonic() - t:.1f}s")
        cache[key].model.aux_hidden_layers = ()
        return cache[key]

    setup.load_model = cached
    try:
        yield cache
    finally:
        setup.load_model = original
        cache.clear()
        free_memory()


def kv_bytes(args) -> int | None:
    """--kv-cache-gib, else a fixed 8 GiB on CUDA (no profiling between engines), engine default on CPU."""
    if getattr(args, "kv_cache_gib", None):
        return int(args.kv_cache_gib * (1 << 30))
    return 8 << 30 if torch.cuda.is_available() else None


def make_llm(args, **kw: Any) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", kv_bytes(args))
    if getattr(args, "dtype", None):
        kw.setdefault("dtype", args.dtype)
    if getattr(args, "max_model_len", None):
        kw.setdefault("max_model_len", args.max_model_len)
    if getattr(args, "load_format", None):
        kw.setdefault("load_format", args.load_format)
    return LLM(model=args.model, progress=False, **kw)


def close_llm(llm: LLM | None) -> None:
    if llm is None:
        return
    with contextlib.suppress(Exception):
        llm.engine.shutdown()
    free_memory()


def stdlib_root() -> Path:
    """The standard library's directory; $SPECSERVE_STDLIB_ROOT points at a copy of its tree (some
    distributions ship Python without test/, turtledemo/ or lib2to3/, where the held-out files are)."""
    return Path(os.environ.get("SPECSERVE_STDLIB_ROOT") or sysconfig.get_paths()["stdlib"])


def held_out_files(root: Path | None = None) -> list[Path]:
    """The held-out files in a fixed order: the explicit list, then the globs (sorted)."""
    root = root or stdlib_root()
    out: list[Path] = []
    for rel in HELD_OUT_FILES:
        if (root / rel).is_file():
            out.append(root / rel)
    for pattern in HELD_OUT_GLOBS:
        for f in sorted(root.glob(pattern)):
            if f not in out:
                out.append(f)
    check_held_out(out, root)
    return out


def check_held_out(files: Sequence[Path], root: Path) -> None:
    """Fail loudly if train_data.py would read any of these files (its skip list changed)."""
    from specserve.spec.train_data import _SKIP_DIRS

    for f in files:
        if not (_SKIP_DIRS & set(f.relative_to(root).parts)):
            raise SystemExit(f"{f} is not held out from specserve/spec/train_data.py any more")


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def generate_until(llm: LLM, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams],
                   budget: Budget, label: str = "", every_s: float = 15.0) -> list[RequestOutput | None]:
    """LLM.generate, all prompts at once, but stops at the budget's deadline: unfinished requests
    are aborted and come back as None. Prints progress now and then."""
    engine = llm.engine
    params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    ids = [f"{label}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params_list):
        engine.add_request(rid, prompt, p)
    done: dict[str, RequestOutput] = {}
    wanted = set(ids)
    last = time.monotonic()
    while len(done) < len(ids):
        if budget.expired():
            log(f"{label}: time budget reached with {len(ids) - len(done)} of {len(ids)} requests unfinished")
            engine.abort_request([i for i in ids if i not in done], emit_output=False)
            break
        for out in engine.step():
            if out.finished and out.request_id in wanted:
                done[out.request_id] = out
        if time.monotonic() - last > every_s:
            last = time.monotonic()
            log(f"{label}: {len(done)}/{len(ids)} finished")
    while engine.has_unfinished_requests():  # drain aborted outputs
        engine.step()
    return [done.get(i) for i in ids]


def result_path(name: str, json_arg: str | None) -> Path | None:
    if json_arg:
        return Path(json_arg)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / f"{name}.json"
    return None


def write_json(name: str, json_arg: str | None, result: dict) -> None:
    path = result_path(name, json_arg)
    if path is None:
        log("no --json and no $OUT: JSON not written")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    log(f"wrote {path}")


def md_table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    """cols: (key, header). Floats get 4 significant digits; missing values print as '-'."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines)


def add_common_args(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalog name, .gguf file or HF dir")
    p.add_argument("--dtype", default=None, help="weights/activations dtype (default: engine's auto)")
    p.add_argument("--load-format", default=None,
                   help="dummy: random weights of a shape name (timing only: tier_ttft uses token-id documents)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV pool per engine in GiB (default 8 on CUDA, engine default on CPU)")
    p.add_argument("--time-budget-s", type=float, default=None, help="stop starting new work after this")
    p.add_argument("--json", default=None, help="result path (default $OUT/<name>.json when OUT is set)")


def environment() -> dict:
    return {"device": device_name(), "torch": torch.__version__, "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
