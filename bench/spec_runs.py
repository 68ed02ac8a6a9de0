"""The speculative benchmark's engines and models (bench/spec_bench.py runs and reports them).

HumanEval prompts, one model load shared by every LLM built inside `shared_models`, the
configurations, and the Runner that builds each configuration's specserve engine (or the
transformers model on the same tensors: plain, assisted generation, prompt lookup) once and runs
groups of prompts on it.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from env_var import env_set  # noqa: E402
from kv_common import free_memory  # noqa: E402  (the same gc + empty_cache)
from specserve import LLM, SamplingParams  # noqa: E402

SPEC_METHODS = ("ngram", "draft_model", "eagle3", "p-eagle")
HF_METHODS = ("hf", "hf_assisted", "hf_prompt_lookup")
NGRAM_MIN, NGRAM_MAX = 2, 5


def humaneval_prompts(n: int, path: str | None = None) -> list[str]:
    """The first n HumanEval problems as chat requests (measuring only: never train on these)."""
    from humaneval_kv import load_problems

    return [f"Complete the following Python function.\n\n```python\n{p['prompt']}```" for p in load_problems(path, n)]


@contextlib.contextmanager
def shared_models() -> Iterator[dict]:
    """Every LLM built inside shares loaded models by (reference, dtype, length, device)."""
    import specserve.runner.build as setup
    import specserve.spec.draft_model as draft_model

    cache: dict[tuple, Any] = {}
    original = setup.load_model

    def cached(cfg, device, dtype, *args, **kwargs):
        key = (cfg.model, str(dtype), cfg.max_model_len, str(device), cfg.load_format)
        if key not in cache:
            cache[key] = original(cfg, device, dtype, *args, **kwargs)
        cache[key].model.aux_hidden_layers = ()  # an EAGLE engine may have set them; it restores its own
        return cache[key]

    setup.load_model = draft_model.load_model = cached
    try:
        yield cache
    finally:
        setup.load_model = draft_model.load_model = original
        cache.clear()
        free_memory()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Config:
    method: str  # none | ngram | draft_model | eagle3 | p-eagle | hf | hf_assisted | hf_prompt_lookup
    k: int
    batch: int
    tag: str = ""  # "#2": a second instance of the baseline (bracketing); VARIANT_TAGS: an A/B variant

    @property
    def name(self) -> str:
        return f"{self.method}{self.tag} k={self.k} b={self.batch}"

    @property
    def is_hf(self) -> bool:
        return self.method in HF_METHODS


def spec_config(method: str, k: int, args) -> dict | None:
    if method == "none":
        return None
    cfg: dict[str, Any] = {"num_speculative_tokens": k, "adaptive": False}
    if method == "ngram":
        cfg.update(method="ngram", prompt_lookup_min=NGRAM_MIN, prompt_lookup_max=NGRAM_MAX)
    elif method == "draft_model":
        cfg.update(method="draft_model", model=args.draft)
    elif method == "eagle3":
        cfg.update(method="eagle3", model=args.eagle3_head)
    elif method == "p-eagle":
        cfg.update(method="eagle3", model=args.p_eagle_head, parallel_drafting=True)
    return cfg


def default_kv_bytes(args) -> int:
    if args.kv_bytes:
        return args.kv_bytes
    return (512 << 20) if _device_type(args) == "cuda" else (256 << 20)


def _device_type(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if args.device.startswith("cuda") else "cpu"


# Config tags of an A/B in one process (`--runs eagle3:4:defer0`): the engine is built with the
# variable set (each is read when an engine is built; see specserve/envs.py).
VARIANT_TAGS = {"#defer0": ("SPECSERVE_DEFER_DRAFTS", "0"), "#defer1": ("SPECSERVE_DEFER_DRAFTS", "1"),
                "#chain1": ("SPECSERVE_DRAFT_CHAIN_GRAPH", "1"), "#pieces0": ("SPECSERVE_PREFILL_PIECES", "0"),
                "#skinny0": ("SPECSERVE_SKINNY", "0")}


# -- running configurations -------------------------------------------------------------------
@dataclass
class Runner:
    """Builds each configuration's engine (or HF model) once and runs groups of prompts on it."""

    args: argparse.Namespace
    cache: dict
    engines: dict[Config, tuple[LLM, tuple[int, ...]]] = field(default_factory=dict)
    hf: dict[str, Any] = field(default_factory=dict)
    build_seconds: dict[str, float] = field(default_factory=dict)

    def engine(self, c: Config) -> tuple[LLM, tuple[int, ...]]:
        if c not in self.engines:
            start = time.monotonic()
            a = self.args
            name, value = VARIANT_TAGS.get(c.tag, ("", None))
            with env_set(name, value):  # read when the engine is built (and its graphs captured)
                llm = LLM(model=a.target, progress=False, speculative_config=spec_config(c.method, c.k, a),
                          max_model_len=a.max_model_len, max_num_seqs=c.batch, device=a.device,
                          kv_cache_memory_bytes=default_kv_bytes(a), load_format=a.load_format)
            # Engines share one model object; an EAGLE engine needs its aux layers set, the others none.
            aux = tuple(llm.engine.runner.model.aux_hidden_layers)
            llm.generate([{"prompt_token_ids": list(range(100, 132))}] * c.batch,
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            self.engines[c] = (llm, aux)
            self.build_seconds[c.name] = round(time.monotonic() - start, 2)
            print(f"    built {c.name} in {self.build_seconds[c.name]:.1f}s", flush=True)
        return self.engines[c]

    def run(self, c: Config, prompt_ids: list[list[int]]) -> dict:
        return self._run_hf(c, prompt_ids) if c.is_hf else self._run_specserve(c, prompt_ids)

    def _run_specserve(self, c: Config, prompt_ids: list[list[int]]) -> dict:
        llm, aux = self.engine(c)
        llm.engine.runner.model.aux_hidden_layers = aux
        params = SamplingParams(temperature=0.0, max_tokens=self.args.max_tokens, ignore_eos=self.args.ignore_eos)
        st = llm.engine.stats
        names = ("spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_draft_tokens_total")
        before = [st.get(n) for n in names]
        _sync()
        start = time.perf_counter()
        with env_set(*VARIANT_TAGS.get(c.tag, ("", None))):  # and while it runs (eager forwards read some)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
        _sync()
        wall = time.perf_counter() - start
        drafts, accepted, drafted = (st.get(n) - b for n, b in zip(names, before))
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        # Per request: arrival to first token (the prefill), and first to last token (the decode steps,
        # speculative or not): a request's fixed costs and its per-step costs apart.
        times = [o.metrics for o in outs]
        ttft = [m.first_token_time - m.arrival_time for m in times if m and m.first_token_time]
        decode = [m.last_token_time - m.first_token_time for m in times if m and m.first_token_time and m.last_token_time]
        return {"tokens": sum(map(len, outputs)), "seconds": wall, "drafts": drafts, "accepted": accepted,
                "draft_tokens": drafted, "outputs": outputs, "ttft_s": ttft, "decode_s": decode}

    def loaded(self, which: str):
        """The specserve LoadedModel of the target or the draft (from the shared cache)."""
        target_llm = self.engine(Config("none", 0, 1))[0]
        if which == "target":
            return target_llm.engine.loaded
        import specserve.spec.draft_model as draft_model
        from specserve.config import SpeculativeConfig

        cfg = SpeculativeConfig(method="draft_model", model=self.args.draft, num_speculative_tokens=1)
        return draft_model._load_draft(cfg, _Parts(target_llm.engine.loaded, target_llm.engine.device))

    def hf_model(self, which: str):
        if which not in self.hf:
            start = time.monotonic()
            eos = self.engine(Config("none", 0, 1))[0].engine.eos_token_ids
            if self.args.hf_load == "share":
                from hf_shared import hf_model_sharing

                self.hf[which] = hf_model_sharing(self.loaded(which), eos)
            else:
                self.hf[which] = _hf_load(self.args.target if which == "target" else self.args.draft,
                                          self.loaded("target").model.embed_tokens.weight.device, eos)
            self.build_seconds[f"hf {which}"] = round(time.monotonic() - start, 2)
        return self.hf[which]

    def _run_hf(self, c: Config, prompt_ids: list[list[int]]) -> dict:
        assert len(prompt_ids) == 1, "transformers runs batch 1"
        target = self.hf_model("target")
        device = target.model.embed_tokens.weight.device
        kw: dict[str, Any] = {}
        if c.method == "hf_assisted":
            draft = self.hf_model("draft")
            draft.generation_config.num_assistant_tokens = c.k
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            kw["assistant_model"] = draft
        elif c.method == "hf_prompt_lookup":
            kw["prompt_lookup_num_tokens"] = c.k
        if self.args.ignore_eos:
            kw["min_new_tokens"] = self.args.max_tokens
        key = f"warm {c.method}"
        if key not in self.hf:  # first-call allocations and kernel choices, as the engines' warm-up
            with torch.no_grad():
                target.generate(torch.tensor([list(range(100, 132))], device=device), max_new_tokens=8, **kw)
            self.hf[key] = True
        x = torch.tensor(prompt_ids, device=device)
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(x, max_new_tokens=self.args.max_tokens, do_sample=False, **kw)
        _sync()
        wall = time.perf_counter() - start
        outputs = [out[0, len(prompt_ids[0]):].tolist()]
        eos = set(target.generation_config.eos_token_id)
        for o in outputs:  # HF pads nothing at batch 1, but cut at the first EOS like the engine
            for i, t in enumerate(o):
                if t in eos and not self.args.ignore_eos:
                    del o[i + 1:]
                    break
        return {"tokens": sum(map(len, outputs)), "seconds": wall, "drafts": 0, "accepted": 0, "draft_tokens": 0,
                "outputs": outputs}


@dataclass
class _Parts:
    loaded: Any
    device: torch.device


def _hf_load(ref: str, device: torch.device, eos: tuple[int, ...]):
    """transformers' own GGUF / HF-dir loading (a second copy of the weights; --hf-load gguf)."""
    from transformers import AutoModelForCausalLM

    from specserve.model.catalog import resolve_model

    resolved = resolve_model(ref)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if resolved.kind == "gguf":
        path = Path(resolved.path)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = list(eos), eos[0]
    return model.to(device).eval()
