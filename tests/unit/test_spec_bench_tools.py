"""The speculative benchmark's helpers: acceptance replayed for any k equals what the engine measures,
transformers on specserve's own tensors decodes like specserve, and the held-out stdlib files
never reach draft-head training."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.train import data as train_data
from tests.helpers.tiny_models import make_tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from hf_shared import hf_model_sharing  # noqa: E402
from spec_sim import _walk, draft_agreement, simulate_draft, simulate_ngram  # noqa: E402

MAX_TOKENS = 40


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(10, 300, (7,), generator=g).tolist()
    return [motif * 3 + [11, 12], torch.randint(10, 300, (30,), generator=g).tolist(), motif + [9] + motif]


def _run(target: str, spec: dict | None, prompts: list[list[int]]) -> tuple[list[list[int]], float | None]:
    llm = LLM(model=target, progress=False, kv_cache_memory_bytes=8 << 20, speculative_config=spec)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    st = llm.engine.stats
    drafts = st.get("spec_decode_num_drafts_total")
    al = 1 + st.get("spec_decode_num_accepted_tokens_total") / drafts if drafts else None
    return [list(o.outputs[0].token_ids) for o in outs], al


def _mean_al(totals: list[tuple[int, int, int]]) -> float:
    return 1 + sum(t[2] for t in totals) / sum(t[0] for t in totals)


@pytest.mark.parametrize("k", [1, 3])
def test_replayed_acceptance_equals_measured(tiny_llama_dir, tmp_path, k):
    target = str(tiny_llama_dir)
    draft_dir = str(make_tiny_model_dir(tmp_path / "draft", arch="llama", seed=11, num_layers=1))
    prompts = _prompts()
    plain, _ = _run(target, None, prompts)
    ngram_out, ngram_al = _run(target, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                                        "prompt_lookup_max": 5, "adaptive": False}, prompts)
    draft_out, draft_al = _run(target, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k,
                                        "adaptive": False}, prompts)
    assert ngram_out == plain and draft_out == plain
    sim = [simulate_ngram(p, o, MAX_TOKENS, k, 2, 5) for p, o in zip(prompts, plain)]
    assert _mean_al(sim) == pytest.approx(ngram_al, abs=1e-9)
    draft = LLM(model=draft_dir, progress=False, kv_cache_memory_bytes=1 << 20).engine.loaded
    sim = [simulate_draft(draft_agreement(draft, p, o), len(o), MAX_TOKENS, k) for p, o in zip(prompts, plain)]
    assert _mean_al(sim) == pytest.approx(draft_al, abs=1e-9)


def test_walk_all_accepted_is_k_plus_one():
    drafts, drafted, accepted = _walk(1 + 4 * 5, 1000, 4, lambda j, budget: (budget, budget))
    assert (drafts, drafted, accepted) == (4, 16, 16)  # the prefill samples the first token


def test_hf_on_shared_tensors_decodes_like_specserve(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    hf = hf_model_sharing(llm.engine.loaded, llm.engine.eos_token_ids)
    assert hf.model.embed_tokens.weight.data_ptr() == llm.engine.loaded.model.embed_tokens.weight.data_ptr()
    for prompt in _prompts():
        ours = llm.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert theirs[0, len(prompt):].tolist() == list(ours)


def test_held_out_stdlib_files_are_never_training_sources():
    held = train_data.held_out_stdlib_files()
    assert len(held) >= len(train_data.HELD_OUT_STDLIB_MODULES) - 2  # every CPython ships nearly all of them
    sources = set(train_data._stdlib_files())
    assert sources and not sources & set(held)
