"""bench/compile_log.describe: a mid-serving compile is named with what tells its variant apart."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from compile_log import describe  # noqa: E402


def test_a_compile_names_its_constexprs_and_divisible_arguments() -> None:
    compile = {"constants": {(22,): 7, (23,): 64},
               "configs": [{(0,): [["tt.divisibility", 16]], (5,): [["tt.divisibility", 16]], (3,): [["tt.other", 1]]}]}
    assert describe("_paged_attention_kernel", compile) == "_paged_attention_kernel {(22,): 7, (23,): 64} div16=[0, 5]"


def test_a_compile_without_attributes_still_reads() -> None:
    assert describe("k", {"constants": {}}) == "k {} div16=[]"
