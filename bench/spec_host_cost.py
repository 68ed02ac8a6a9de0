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
policy's median over rounds of ms per engine step and output tokens/s, the median engine step, the
steps it drafted in, the controller's own time per step (its choose and observe, timed around the
calls), and each policy's time per step in the engine's sections (schedule, execute, resolve,
launch_sampling, update, observe_step, deliver, propose, skip_proposal; every policy pays the same few
microseconds of their timers): where a policy's extra time per step goes, beyond its controller's own.

    python bench/spec_host_cost.py                       # H200: the dummy Qwen2.5 1.5B / 0.5B shapes
    python bench/spec_host_cost.py --model /tiny --draft /tiny --device cpu --levels 16 --rounds 1 \
        --kv-gib 0.25                                    # CPU smoke
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
        self.inner, self.seconds, self.calls, self.drafting = inner, 0.0, 0, 0

    def choose(self, batch_size: int) -> int:
        t = time.perf_counter()
        k = self.inner.choose(batch_size)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        self.drafting += k > 0
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


class _Sections:
    """Seconds per named section of an engine step (scheduling, the forward's launch, resolving the step in
    flight, ...), summed into `into` while installed: where a policy's extra time per step goes."""

    def __init__(self, llm: LLM) -> None:
        eng = llm.engine
        self.into: dict[str, float] = {}
        targets = [("schedule", eng.scheduler, "schedule"), ("execute", eng.runner, "execute"),
                   ("resolve", eng, "_resolve"), ("launch_sampling", eng, "_launch_sampling"),
                   ("update", eng, "_update")]
        if eng.spec is not None:
            targets += [("observe_step", eng.spec, "observe_step"), ("deliver", eng.spec, "deliver"),
                        ("propose", eng.spec, "propose"), ("skip_proposal", eng.spec, "skip_proposal")]
        for name, obj, attr in targets:
            self._wrap(name, obj, attr)

    def _wrap(self, name: str, obj, attr: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.into[name] = self.into.get(name, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)


def _part(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int, int, float]:
    """(seconds, engine steps, output tokens, median ms of an engine step) of one closed batch."""
    eng = llm.engine
    walls: list[float] = []
    step = eng.step

    def counted():
        t = time.perf_counter()
        try:
            return step()
        finally:
            walls.append(time.perf_counter() - t)

    eng.step = counted
    try:
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        seconds = time.perf_counter() - t
    finally:
        del eng.step
    return seconds, len(walls), sum(len(o.outputs[0].token_ids) for o in outs), 1e3 * statistics.median(walls)


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
    sections = {name: _Sections(llm) for name, llm in engines.items()}
    result = {"config": vars(args), "levels": {}}
    for c in levels:
        rows: dict[str, list[tuple[float, int, int, float, float, int]]] = {name: [] for name in policies}
        split: dict[str, dict[str, float]] = {name: {} for name in policies}  # section seconds over the parts
        for r in range(args.rounds):
            order = policies[r % len(policies):] + policies[:r % len(policies)]  # each policy in each slot
            for name in order:
                engine_name = "off" if name == "off" else "spec"
                llm = engines[engine_name]
                ctl = controllers.get(name)
                if ctl is not None:
                    spec.controller, spec._proposal = ctl, None
                    before = (ctl.seconds, ctl.calls, ctl.drafting)
                sections[engine_name].into = split[name]
                seconds, steps, tokens, p50 = _part(llm, prompts[:c], args.output_len)
                own = (ctl.seconds - before[0]) / max(ctl.calls - before[1], 1) if ctl is not None else 0.0
                drafting = ctl.drafting - before[2] if ctl is not None else 0
                rows[name].append((seconds, steps, tokens, own, p50, drafting))
        table = {}
        for name, rs in rows.items():
            steps = sum(r[1] for r in rs)
            table[name] = {"ms_per_step": statistics.median(1e3 * r[0] / r[1] for r in rs),
                           "tokens_per_s": statistics.median(r[2] / r[0] for r in rs),
                           "controller_us_per_step": statistics.median(1e6 * r[3] for r in rs),
                           "step_p50_ms": statistics.median(r[4] for r in rs),
                           "section_ms_per_step": {k: round(1e3 * v / steps, 4) for k, v in split[name].items()},
                           "parts": [[round(r[0], 4), r[1], r[2], round(r[4], 3), r[5]] for r in rs]}
        held = controllers["adaptive"].inner
        table["adaptive"]["held_share"] = held.num_held / max(held.num_choices, 1)
        result["levels"][str(c)] = table
        print(f"\nconcurrency {c} (median of {args.rounds} parts; controller: its choose + observe per step)")
        print("| policy | ms per step | step p50 ms | output tokens/s | / off | controller us per step "
              "| drafting steps |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        base = table["off"]["tokens_per_s"]
        for name in policies:
            t = table[name]
            print(f"| {name} | {t['ms_per_step']:.3f} | {t['step_p50_ms']:.3f} | {t['tokens_per_s']:,.0f} | "
                  f"{t['tokens_per_s'] / base:.3f} | {t['controller_us_per_step']:.1f} | "
                  f"{sum(part[4] for part in t['parts'])} |")
        names = sorted({k for name in policies for k in table[name]["section_ms_per_step"]})
        print("ms per step by section: " + "; ".join(
            f"{name}: " + " ".join(f"{k}={table[name]['section_ms_per_step'].get(k, 0.0):.3f}" for k in names)
            for name in policies))
        print(f"adaptive: {100 * table['adaptive']['held_share']:.0f}% of its choices so far held")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "spec_host_cost.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
