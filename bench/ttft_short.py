"""Time to first token of one short prompt at a time, prefill-graph pieces on and off.

Without speculation an engine feeds a prompt of up to 4 x 64 tokens, while at most two requests are
live, in 64-token pieces that replay captured prefill graphs (scheduler/scheduler.py prefill_piece);
`SPECSERVE_PREFILL_PIECES=0` runs it as one eager forward, as before. This times both, alternating,
over prompt lengths (TTFT: the engine's own first-token time minus arrival; median of --repeats,
after one untimed warm request per length), and prints a table; --out writes JSON.

    python3 bench/ttft_short.py [--model qwen2.5-1.5b --load-format dummy] [--lengths 32,100,172,256,400]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from env_var import env_set  # noqa: E402
from specserve import LLM, SamplingParams  # noqa: E402


def _engine(args, pieces: bool) -> LLM:
    with env_set("SPECSERVE_PREFILL_PIECES", "1" if pieces else "0"):  # read when the engine is built
        return LLM(model=args.model, load_format=args.load_format, max_model_len=args.max_model_len,
                   max_num_seqs=8, kv_cache_memory_bytes=args.kv_bytes, progress=False,
                   enable_prefix_caching=False, device=args.device)


def _ttft_ms(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    m = out[0].metrics
    return 1e3 * (m.first_token_time - m.arrival_time)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="auto")
    p.add_argument("--lengths", default="32,100,172,256,400")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-bytes", type=int, default=1 << 30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engines = {"pieces": _engine(args, True), "whole": _engine(args, False)}
    for name, llm in engines.items():
        print(f"{name}: prefill_piece = {llm.engine.scheduler.prefill_piece}", flush=True)
    rng = random.Random(0)
    vocab = engines["pieces"].engine.vocab_size
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        times: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.repeats + 1):
            for name, llm in (engines.items() if r % 2 else reversed(list(engines.items()))):
                t = _ttft_ms(llm, [rng.randrange(100, min(vocab, 30000)) for _ in range(n)])
                if r:  # the first round is a warm-up
                    times[name].append(t)
        row = {"prompt_tokens": n, **{f"{k}_ms": round(statistics.median(v), 2) for k, v in times.items()}}
        rows.append(row)
        print(f"{n:6d} tokens  pieces {row['pieces_ms']:8.2f} ms  whole {row['whole_ms']:8.2f} ms  "
              f"ratio {row['pieces_ms'] / row['whole_ms']:.2f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
