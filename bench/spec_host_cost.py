"""What speculation's bookkeeping costs per step where it drafts nothing: high load, host-bound steps.

At 64-256 requests the adaptive controller chooses k = 0, and each step runs overlapped (engine/
overlap.py); the engine's host work then bounds the step, so the controller's own (choose, observe, the
empty proposal's record) is paid on every step. One process, one engine without speculation ("off")
and one with a draft model whose controller is swapped between parts:
  k=0              a controller that always says 0 (no controller work: the engine's own cost of a proposer)
  adaptive         the default AdaptiveController
  adaptive-priced  the same without its hold (AdaptiveSettings.hold_margin=None): every choice priced
The parts alternate (off, k=0, adaptive, adaptive-priced, then the next round), each a closed batch of
`c` requests of `--input-len` random tokens and `--output-len` greedy tokens. Prints, per level, each
policy's median over rounds of ms per engine step and output tokens/s, and the controller's own time
per step (its choose and observe, timed around the calls).

    python bench/spec_host_cost.py                       # H200: the dummy Qwen2.5 1.5B / 0.5B shapes
    python bench/spec_host_cost.py --model /tiny --draft /tiny --device cpu --levels 16 --rounds 1   # smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path

from specserve import LLM, SamplingParams
from specserve.model.shapes import SHAPES
from specserve.spec.adaptive import AdaptiveController, AdaptiveSettings
from specserve.spec.controller import FixedController


class _Timed:
    """Wraps a controller's choose / observe with timers (their seconds summed), passing the rest on."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def choose(self, batch_size: int) -> int:
        t = time.perf_counter()
        k = self.inner.choose(batch_size)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return k

    def observe(self, step) -> None:
        t = time.perf_counter()
        self.inner.observe(step)
        self.seconds += time.perf_counter() - t

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _controllers(cfg) -> dict[str, object]:
    zero = FixedController(dataclasses.replace(cfg, adaptive=False))
    zero.k = 0
    return {"k=0": zero, "adaptive": AdaptiveController(cfg),
            "adaptive-priced": AdaptiveController(cfg, AdaptiveSettings(hold_margin=None))}


def _part(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int, int]:
    """(seconds, engine steps, output tokens) of one closed batch."""
    eng = llm.engine
    steps = [0]
    step = eng.step

    def counted():
        steps[0] += 1
        return step()

    eng.step = counted
    try:
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        seconds = time.perf_counter() - t
    finally:
        del eng.step
    return seconds, steps[0], sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--draft", default="qwen2.5-0.5b")
    p.add_argument("--device", default="auto")
    p.add_argument("--levels", default="64,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", type=int, default=12)
    p.add_argument("--kv-gib", type=float, default=8.0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    levels = [int(c) for c in args.levels.split(",")]
    fmt = {"load_format": "dummy"} if args.model in SHAPES else {}
    kw = dict(progress=False, max_num_seqs=max(levels), enable_prefix_caching=False, device=args.device,
              kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)), max_model_len=args.input_len + args.output_len + 64,
              **fmt)
    spec_cfg = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}  # (dummy as the target)
    engines = {"off": LLM(model=args.model, **kw), "spec": LLM(model=args.model, speculative_config=spec_cfg, **kw)}
    spec = engines["spec"].engine.spec
    controllers = {name: _Timed(c) for name, c in _controllers(spec.cfg).items()}
    rng = random.Random(0)
    vocab = engines["off"].engine.vocab_size
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.input_len)] for _ in range(max(levels))]
    policies = ["off", *controllers]
    for name in policies:  # warm-up: every policy at the largest level once (graphs, allocator, JIT)
        llm = engines["off" if name == "off" else "spec"]
        if name != "off":
            spec.controller, spec._proposal = controllers[name], None
        _part(llm, prompts, 16)
    result = {"config": vars(args), "levels": {}}
    for c in levels:
        rows: dict[str, list[tuple[float, int, int, float]]] = {name: [] for name in policies}
        for r in range(args.rounds):
            order = policies[r % len(policies):] + policies[:r % len(policies)]  # each policy in each slot
            for name in order:
                llm = engines["off" if name == "off" else "spec"]
                ctl = controllers.get(name)
                if ctl is not None:
                    spec.controller, spec._proposal = ctl, None
                    before = (ctl.seconds, ctl.calls)
                seconds, steps, tokens = _part(llm, prompts[:c], args.output_len)
                own = (ctl.seconds - before[0]) / max(ctl.calls - before[1], 1) if ctl is not None else 0.0
                rows[name].append((seconds, steps, tokens, own))
        table = {}
        for name, rs in rows.items():
            table[name] = {"ms_per_step": statistics.median(1e3 * s / n for s, n, _, _ in rs),
                           "tokens_per_s": statistics.median(t / s for s, _, t, _ in rs),
                           "controller_us_per_step": statistics.median(1e6 * o for *_, o in rs),
                           "parts": [[round(s, 4), n, t] for s, n, t, _ in rs]}
        held = controllers["adaptive"].inner
        table["adaptive"]["held_share"] = held.num_held / max(held.num_choices, 1)
        result["levels"][str(c)] = table
        print(f"\nconcurrency {c} (median of {args.rounds} parts; controller: its choose + observe per step)")
        print("| policy | ms per step | output tokens/s | / off | controller us per step |")
        print("| --- | --- | --- | --- | --- |")
        base = table["off"]["tokens_per_s"]
        for name in policies:
            t = table[name]
            print(f"| {name} | {t['ms_per_step']:.3f} | {t['tokens_per_s']:,.0f} | {t['tokens_per_s'] / base:.3f} | "
                  f"{t['controller_us_per_step']:.1f} |")
        print(f"adaptive: {100 * table['adaptive']['held_share']:.0f}% of its choices so far held")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "spec_host_cost.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
