"""SPECSERVE_PDL parsing, where programmatic dependent launch may be used, and what the attention
kernels may load before their PDL wait (kernels/pdl.py)."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest
import torch

from specserve import envs
from specserve.kernels.pdl import use_pdl


def test_pdl_variable(monkeypatch) -> None:
    monkeypatch.delenv("SPECSERVE_PDL", raising=False)
    assert envs.pdl() is True
    monkeypatch.setenv("SPECSERVE_PDL", "0")
    assert envs.pdl() is False
    monkeypatch.setenv("SPECSERVE_PDL", "yes")
    with pytest.raises(ValueError, match="SPECSERVE_PDL"):
        envs.pdl()


def test_never_on_cpu_tensors(monkeypatch) -> None:
    monkeypatch.setenv("SPECSERVE_PDL", "1")
    assert use_pdl(torch.zeros(2)) is False


def test_gemv_prefetch_rule() -> None:
    """Without a tuned `prefetch` entry (the CPU has no table) only short reductions prefetch."""
    from specserve.model.layers import triton_gemv

    def prefetch(k: int) -> bool:
        return triton_gemv._prefetch(2048, k, 1, torch.device("cpu"))

    assert prefetch(1536) and prefetch(triton_gemv.PREFETCH_MAX_K)
    assert not prefetch(4096)


# -- what the decode-path attention kernels load before their PDL wait ------------------------------
# Read from the kernels' source (no GPU, no interpreter). Before `pdl_prologue(` only batch metadata
# and constant tables may be touched (kernels/pdl.py); q/k/v, the KV cache, the split-KV
# partials, counters and the output only after it, and no store or return may come first.
PRE_WAIT_ALLOWED = frozenset(
    {"positions_ptr", "slot_mapping_ptr", "seq_lens_ptr", "cu_query_lens_ptr", "block_tables_ptr", "cos_sin_ptr"}
)
# kernel (module, name) -> (pointers it must read before the wait, pointers it must touch after it)
PRE_WAIT_KERNELS = {
    ("specserve.attention.triton_rope_cache", "_rope_and_cache_kernel"): (
        {"positions_ptr", "cos_sin_ptr", "slot_mapping_ptr"},
        {"q_ptr", "k_ptr", "v_ptr", "key_cache_ptr"},
    ),
    ("specserve.attention.triton_paged", "_paged_attention_kernel"): (
        {"cu_query_lens_ptr", "seq_lens_ptr", "block_tables_ptr"},
        {"q_ptr", "key_cache_ptr", "part_m_ptr"},
    ),
    ("specserve.attention.triton_paged", "_reduce_splits_kernel"): (
        {"cu_query_lens_ptr"},
        {"part_m_ptr", "part_acc_ptr", "out_ptr"},
    ),
    ("specserve.attention.triton_kv_write", "_reshape_and_cache_kernel"): (
        {"slot_mapping_ptr"},
        {"key_ptr", "value_ptr", "key_cache_ptr"},
    ),
}


def _kernel_def(module: str, name: str):
    pytest.importorskip("triton")
    kernel = getattr(importlib.import_module(module), name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _is_call(node, name: str) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name)


def _pointer_deps(stmts, params: set[str]):
    """A function of an expression -> the `*_ptr` parameters its value derives from, through the
    local assignments in `stmts` (transitively; an over-approximation)."""
    assigned: dict[str, set[str]] = {}
    for node in (n for s in stmts for n in ast.walk(s)):
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets, value = [node.target], node.value
        elif isinstance(node, ast.For):
            targets, value = [node.target], node.iter
        names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)} if value is not None else set()
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    assigned.setdefault(n.id, set()).update(names)

    def deps(expr) -> set[str]:
        out, todo, seen = set(), [n.id for n in ast.walk(expr) if isinstance(n, ast.Name)], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in params and name.endswith("_ptr"):
                out.add(name)
            todo.extend(assigned.get(name, ()))
        return out

    return deps


def _memory_accesses(stmts, deps):
    """[(what, pointers)] for every load, store, atomic or helper call (a @triton.jit function given
    pointers) in `stmts`; what is 'load', 'store' or 'call <name>'."""
    found = []
    for node in (n for s in stmts for n in ast.walk(s)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl":
            if f.attr == "load":
                ptr = node.args[0] if node.args else next(k.value for k in node.keywords if k.arg == "pointer")
                found.append(("load", deps(ptr)))
            elif f.attr == "store" or f.attr.startswith("atomic_"):
                found.append(("store", set().union(*(deps(a) for a in node.args))))
        elif isinstance(f, ast.Name) and f.id != "pdl_prologue":
            ptrs = set().union(set(), *(deps(a) for a in [*node.args, *(k.value for k in node.keywords)]))
            if ptrs:
                found.append((f"call {f.id}", ptrs))
    return found


def _pre_wait_problems(fn) -> tuple[list[str], set[str], set[str]]:
    """(problems, pointers read before the wait, pointers touched after it) of a kernel's FunctionDef."""
    params = {a.arg for a in fn.args.args}
    waits = [n for n in ast.walk(fn) if _is_call(n, "pdl_prologue")]
    top = [i for i, s in enumerate(fn.body) if isinstance(s, ast.Expr) and _is_call(s.value, "pdl_prologue")]
    if len(waits) != 1 or len(top) != 1:
        problem = f"expected one unconditional top-level pdl_prologue call: {len(waits)} calls, {len(top)} at top level"
        return [problem], set(), set()
    before, after = fn.body[: top[0]], fn.body[top[0] + 1 :]
    problems = [
        f"return before the wait (line {n.lineno})" for s in before for n in ast.walk(s) if isinstance(n, ast.Return)
    ]
    pre = set()
    for what, ptrs in _memory_accesses(before, _pointer_deps(before, params)):
        if what == "store":
            problems.append(f"store through {sorted(ptrs)} before the wait")
        elif ptrs - PRE_WAIT_ALLOWED:
            problems.append(f"{what} of {sorted(ptrs - PRE_WAIT_ALLOWED)} before the wait")
        pre |= ptrs
    post = set().union(set(), *(p for _, p in _memory_accesses(after, _pointer_deps(fn.body, params))))
    return problems, pre, post


@pytest.mark.parametrize("module,name", list(PRE_WAIT_KERNELS))
def test_only_metadata_is_read_before_the_pdl_wait(module: str, name: str) -> None:
    must_pre, must_post = PRE_WAIT_KERNELS[(module, name)]
    problems, pre, post = _pre_wait_problems(_kernel_def(module, name))
    assert not problems, f"{name}: {problems}"
    assert must_pre <= pre, f"{name}: metadata no longer read before the wait: {sorted(must_pre - pre)}"
    assert must_post <= post, f"{name}: the check no longer sees the kernel's data path: {sorted(must_post - post)}"


@pytest.mark.parametrize("module,name", list(PRE_WAIT_KERNELS))
def test_pre_wait_check_catches_a_late_wait(module: str, name: str) -> None:
    """The guard can fail: with the wait moved to the end of the kernel, or down past the first
    statement that touches activations, the KV cache or partials, it reports the kernel."""
    fn = _kernel_def(module, name)
    i = next(i for i, s in enumerate(fn.body) if isinstance(s, ast.Expr) and _is_call(s.value, "pdl_prologue"))
    wait = fn.body.pop(i)
    params = {a.arg for a in fn.args.args}
    deps = _pointer_deps(fn.body, params)
    first_data = next(
        j for j, s in enumerate(fn.body) if j >= i and any(p - PRE_WAIT_ALLOWED for _, p in _memory_accesses([s], deps))
    )
    for at in (first_data + 1, len(fn.body)):
        fn.body.insert(at, wait)
        assert _pre_wait_problems(fn)[0], f"{name} with the wait after statement {at}: not reported"
        fn.body.pop(at)
