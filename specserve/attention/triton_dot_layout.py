"""Float16 dot operands in the 16-bit register layout (kWidth 2) for kernels that also load 8-bit data
(Triton 3.6 gives them the 8-bit one, costing register moves). `install()` hooks the CUDA "ttgir" stage
of kernels named with `KWIDTH2_SUFFIX`: Triton 3.6's pass list (checked by `_MAKE_TTGIR_SHA256`; other
Tritons get no hook), split after AccelerateMatmul. A failure falls back to the original stage.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

KWIDTH2_SUFFIX = "_kw2"
# sha256 of inspect.getsource(CUDABackend.make_ttgir) in Triton 3.6.0
_MAKE_TTGIR_SHA256 = "806a6c72a470b1ffe3caebde353775863ca4a1f68ab8209b7b093507be3985b6"
# a 16-bit float operand with the 8-bit layout: "...xf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>"
_KWIDTH4_16BIT = re.compile(r"(x(?:f16|bf16), #ttg\.dot_op<\{opIdx = [01], parent = #\w+), kWidth = 4\}>")
_installed = False


def retarget_kwidth(ttgir: str) -> str:
    """The module text with every 16-bit dot operand at kWidth 2; the same object when any kWidth-4
    operand is not 16-bit."""
    new, count = _KWIDTH4_16BIT.subn(r"\1, kWidth = 2}>", ttgir)
    return new if count and "kWidth = 4}" not in new else ttgir


def _parse(text: str, context: Any) -> Any:
    from triton._C.libtriton import ir

    fd, path = tempfile.mkstemp(suffix=".ttgir")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        mod = ir.parse_mlir_module(path, context)
    finally:
        os.unlink(path)
    mod.context = context
    return mod


def _make_ttgir_kw2(mod: Any, metadata: dict, opt: Any, capability: int) -> Any:
    """CUDABackend.make_ttgir of Triton 3.6 (sm_8x / sm_9x) with retarget_kwidth after AccelerateMatmul."""
    from triton._C.libtriton import ir, nvidia, passes

    if opt.maxnreg is not None:
        mod.set_attr("ttg.maxnreg", ir.builder(mod.context).get_int32_attr(opt.maxnreg))
    context = mod.context
    pm = ir.pass_manager(context)
    dump_enabled = pm.enable_debug()
    passes.ttir.add_convert_to_ttgpuir(pm, f"cuda:{capability}", opt.num_warps, 32, opt.num_ctas)
    passes.ttgpuir.add_coalesce(pm)
    passes.ttgpuir.add_f32_dot_tc(pm, True)
    nvidia.passes.ttnvgpuir.add_plan_cta(pm)
    passes.ttgpuir.add_remove_layout_conversions(pm)
    passes.ttgpuir.add_optimize_thread_locality(pm)
    passes.ttgpuir.add_accelerate_matmul(pm)
    pm.run(mod, "make_ttgir")
    text = mod.str()
    edited = retarget_kwidth(text)
    if edited is not text:
        mod = _parse(edited, context)
    pm = ir.pass_manager(context)
    pm.enable_debug()
    passes.ttgpuir.add_remove_layout_conversions(pm)
    passes.ttgpuir.add_optimize_dot_operands(pm, True)
    nvidia.passes.ttnvgpuir.add_optimize_descriptor_encoding(pm)
    passes.ttir.add_loop_aware_cse(pm)
    passes.ttgpuir.add_fuse_nested_loops(pm)
    passes.common.add_canonicalizer(pm)
    passes.ttir.add_triton_licm(pm)
    passes.common.add_canonicalizer(pm)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    nvidia.passes.hopper.add_hopper_warpspec(pm, opt.num_stages, dump_enabled)
    passes.ttgpuir.add_assign_latencies(pm, opt.num_stages)
    passes.ttgpuir.add_schedule_loops(pm)
    passes.ttgpuir.add_pipeline(pm, opt.num_stages, dump_enabled)
    passes.common.add_canonicalizer(pm)
    passes.ttir.add_loop_aware_cse(pm)
    passes.ttgpuir.add_prefetch(pm)
    passes.ttgpuir.add_optimize_dot_operands(pm, True)
    passes.ttgpuir.add_coalesce_async_copy(pm)
    nvidia.passes.ttnvgpuir.add_optimize_tmem_layouts(pm)
    if capability // 10 >= 9:
        nvidia.passes.ttnvgpuir.add_tma_lowering(pm)
    passes.ttgpuir.add_remove_layout_conversions(pm)
    nvidia.passes.ttnvgpuir.add_interleave_tmem(pm)
    passes.ttgpuir.add_reduce_data_duplication(pm)
    passes.ttgpuir.add_reorder_instructions(pm)
    passes.ttir.add_loop_aware_cse(pm)
    passes.common.add_symbol_dce(pm)
    nvidia.passes.ttnvgpuir.add_fence_insertion(pm, capability)
    nvidia.passes.ttnvgpuir.add_lower_mma(pm)
    passes.common.add_sccp(pm)
    passes.common.add_cse(pm)
    passes.common.add_canonicalizer(pm)
    pm.run(mod, "make_ttgir")
    metadata["tensordesc_meta"] = mod.get_tensordesc_metadata()
    return mod


def _retarget_stage(stages: dict, capability: int, options: Any) -> None:
    """Replace stages["ttgir"] for opted-in kernels (sm_8x / sm_9x, Triton language only)."""
    if capability // 10 not in (8, 9) or "ttir" not in stages or "ttgir" not in stages:
        return  # another target, or a Gluon source (no "ttir" stage)
    original = stages["ttgir"]

    def ttgir(src: Any, metadata: dict) -> Any:
        if not src.get_entry_func_name().endswith(KWIDTH2_SUFFIX):
            return original(src, metadata)
        untouched = src.str()
        try:
            return _make_ttgir_kw2(src, metadata, options, capability)
        except Exception as e:  # noqa: BLE001 - any failure: Triton's own layouts instead
            logger.warning(
                "triton_dot_layout: kWidth 2 failed for %s (%s); Triton's layouts instead", src.get_entry_func_name(), e
            )
            return original(_parse(untouched, src.context), metadata)

    stages["ttgir"] = ttgir


def _copied_triton() -> bool:
    """Whether this is Triton 3.6 with the copied pass list (3.9's hook protocol differs)."""
    try:
        import triton
        from triton.backends.nvidia.compiler import CUDABackend

        source = inspect.getsource(CUDABackend.make_ttgir)
    except (ImportError, OSError, TypeError, AttributeError):
        return False
    return triton.__version__.startswith("3.6.") and hashlib.sha256(source.encode()).hexdigest() == _MAKE_TTGIR_SHA256


def install() -> bool:
    """Install the stage hook once per process, chained after any hook there; False on another Triton."""
    global _installed
    if _installed:
        return True
    if not _copied_triton():
        return False
    from triton import knobs

    previous: Callable | None = knobs.runtime.add_stages_inspection_hook

    def hook(backend: Any, stages: dict, options: Any, language: Any, capability: int) -> None:
        if previous is not None:
            previous(backend, stages, options, language, capability)
        _retarget_stage(stages, capability, options)

    knobs.runtime.add_stages_inspection_hook = hook
    _installed = True
    return True
