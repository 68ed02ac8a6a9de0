"""CPU offline benchmark: specserve against transformers on the embedded SmolLM2-135M (float32).

Batch-1 decode tokens/s (the same chat prompt, greedy, --new-tokens new tokens, decode steps only)
and the total throughput of --concurrency requests at once, specserve and transformers (the
baseline, on the same GGUF) in the same run. Runs alternate (A B A B) and report medians, so a busy
machine slows both sides alike.

    python bench/cpu_smollm2.py --new-tokens 64 --concurrency 16 --repeats 3

Writes JSON (--out) and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.model.catalog import model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion briefly.",
    "Name three colors.",
    "What is 12 times 7?",
    "Give me a tip for learning Python.",
    "Describe a cat in one sentence.",
    "What does CPU stand for?",
]


def hf_decode_tok_s(model, ids: torch.Tensor, new: int) -> float:
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **_):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model.generate(
        ids,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([Stamp()]),
    )
    return (len(stamps) - 2) / (stamps[-1] - stamps[1])


def ss_decode_tok_s(llm: LLM, ids: list[int], new: int) -> float:
    eng = llm.engine
    eng.add_request("b1", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    eng.step()  # prefill + first token
    t, n = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        n += 1
    return n / (time.perf_counter() - t)


def ss_concurrent_tok_s(llm: LLM, prompts: list[list[int]], new: int) -> float:
    t = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    )
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def hf_concurrent_tok_s(model, tok, prompts: list[list[int]], new: int) -> float:
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    t = time.perf_counter()
    model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    return len(prompts) * new / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--concurrency", type=int, default=16, help="requests at once in the throughput part")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each side (medians reported)")
    ap.add_argument("--out", default="cpu_smollm2.json", help="result JSON")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = model_path("smollm2-135m-instruct")
    llm = LLM(model="smollm2-135m-instruct", progress=False)
    tok = llm.get_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = llm.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    conc = [
        llm.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        for i in range(args.concurrency)
    ]
    res: dict[str, list[float]] = {"ss_b1": [], "hf_b1": [], "ss_conc": [], "hf_conc": []}
    with torch.inference_mode():
        ss_decode_tok_s(llm, ids, 8)
        hf_decode_tok_s(hf, torch.tensor([ids]), 8)
        for _ in range(args.repeats):
            res["ss_b1"].append(ss_decode_tok_s(llm, ids, args.new_tokens))
            res["hf_b1"].append(hf_decode_tok_s(hf, torch.tensor([ids]), args.new_tokens))
            res["ss_conc"].append(ss_concurrent_tok_s(llm, conc, args.new_tokens))
            res["hf_conc"].append(hf_concurrent_tok_s(hf, tok, conc, args.new_tokens))
    med = {k: statistics.median(v) for k, v in res.items()}
    Path(args.out).write_text(json.dumps({"runs": res, "median": med, "threads": torch.get_num_threads()}, indent=1))
    print(f"torch threads {torch.get_num_threads()}, {args.new_tokens} new tokens, medians of {args.repeats}")
    print(f"{'':28} {'specserve':>10} {'transformers':>13} {'ratio':>6}")
    print(f"{'batch-1 decode tok/s':28} {med['ss_b1']:10.1f} {med['hf_b1']:13.1f} {med['ss_b1'] / med['hf_b1']:6.2f}")
    print(
        f"{f'{args.concurrency} concurrent, total tok/s':28} {med['ss_conc']:10.1f} {med['hf_conc']:13.1f} "
        f"{med['ss_conc'] / med['hf_conc']:6.2f}"
    )


if __name__ == "__main__":
    main()
