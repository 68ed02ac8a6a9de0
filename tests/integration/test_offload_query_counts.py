"""kv_offload_queries_total{tier} counts the lookups a tier could not serve too (in tokens, one probe
per lookup that ends at a block the tier lacks, as the CPU tier counts its first miss): a prompt the
disk tier does not hold is a disk query without a hit. Before, the disk counted only blocks it held,
so its hit rate read ~100% (found by an independent check)."""

from __future__ import annotations

from specserve import LLM, SamplingParams


def _offload(llm: LLM) -> dict[tuple[str, str], float]:
    return {
        (m.name.split(":")[-1], m.labels.get("tier", "")): m.value
        for m in llm.get_metrics()
        if m.name.split(":")[-1] in ("kv_offload_queries_total", "kv_offload_hits_total")
    }


def test_disk_misses_are_queries(tiny_llama_dir, tmp_path) -> None:
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        kv_offload={"disk_path": str(tmp_path / "kv"), "disk_bytes": 64 << 20},
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for seed in range(3):  # three prompts of 40 tokens (2 full blocks of 16) the disk has never seen
        llm.generate({"prompt_token_ids": [(7 * i + 31 * seed) % 300 + 5 for i in range(40)]}, params)
    m = _offload(llm)
    assert m[("kv_offload_queries_total", "disk")] >= 3 * llm.engine.kv.block_size
    assert m[("kv_offload_hits_total", "disk")] == 0
