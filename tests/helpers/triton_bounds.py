"""An address check for Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1).

An over-read does not always show in a kernel's output (a vector load whose extra lanes are
dropped), and on the GPU it faults only when it leaves the allocation; so tests check the addresses
themselves: every masked load and store must stay inside the tensor argument it starts in.
"""

from __future__ import annotations

import pytest
import torch


def watch_addresses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Hooks the interpreter (undone with `monkeypatch`); returns the list it fills with every load /
    store of a kernel whose live addresses run past the end of the tensor argument they start in
    ('load: 12 bytes past the end') or start in none ('load: outside every argument')."""
    import numpy as np
    from triton.runtime import interpreter as interp

    found: list[str] = []
    ranges: list[tuple[int, int]] = []  # [start, end) bytes of each tensor argument's storage
    init_args, load, store = (
        interp.GridExecutor._init_args_hst,
        interp.InterpreterBuilder.create_masked_load,
        interp.InterpreterBuilder.create_masked_store,
    )

    def init_args_hst(self, args_dev, kwargs):
        args, kw = init_args(self, args_dev, kwargs)
        storages = [a.untyped_storage() for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)]
        ranges[:] = [(st.data_ptr(), st.data_ptr() + st.nbytes()) for st in storages]
        return args, kw

    def check(op: str, ptrs, mask) -> None:
        addr = np.asarray(ptrs.data).astype(np.uint64)
        live = addr[np.broadcast_to(np.asarray(mask.data), addr.shape)]
        if live.size:
            lo, hi = int(live.min()), int(live.max()) + ptrs.get_element_ty().primitive_bitwidth // 8
            end = next((b for a, b in ranges if a <= lo < b), None)
            if end is None:
                found.append(f"{op}: outside every argument")
            elif hi > end:
                found.append(f"{op}: {hi - end} bytes past the end")

    def masked_load(self, ptrs, mask, other, *rest):
        check("load", ptrs, mask)
        return load(self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        check("store", ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    monkeypatch.setattr(interp.GridExecutor, "_init_args_hst", init_args_hst)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load", masked_load)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_store", masked_store)
    return found
