"""specserve imports and generates on a CPU machine without triton (DESIGN: the GPU kernels are
imported only when selected). triton reaches most machines only through xgrammar's Linux x86_64
wheels, so elsewhere `from specserve import LLM` must not need it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_and_generate_without_triton(tiny_llama_dir) -> None:
    code = textwrap.dedent(f"""
        import importlib.abc, sys

        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError(f"No module named {{name!r}} (blocked by the test)")
                return None

        sys.meta_path.insert(0, NoTriton())
        from specserve import LLM, SamplingParams
        import specserve.server.api  # noqa: F401
        import specserve.speculative.proposers.eagle, specserve.speculative.proposers.draft_model  # noqa: F401
        llm = LLM(model={str(tiny_llama_dir)!r}, progress=False, kv_cache_memory_bytes=4 << 20,
                  speculative_config={{"method": "ngram", "num_speculative_tokens": 2}})
        out = llm.generate({{"prompt_token_ids": [5, 6, 7, 5, 6, 7]}},
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 5
        assert "triton" not in sys.modules
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
