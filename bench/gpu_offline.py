"""Offline GPU benchmark: specserve against transformers and against the bandwidth floor, dummy weights.

One run measures, per model shape (specserve/model/shapes.py names, random weights of the real shape):
  - device-to-device copy bandwidth -> decode floor = weight bytes / bandwidth (the baseline a
    decode step cannot beat), and the bf16 matmul rate (8192^3) -> a prefill's matmul time;
  - specserve decode ms/step at batch 1 and batch 32 (128-token prompts, --new-tokens new tokens),
    end to end through Engine.step, timed after every prefill finished;
  - transformers on the same shape in the same process: static-cache batch-1 decode ms/step and
    dynamic-cache batch-32 tokens/s (the baseline measured in the same run);
  - offline throughput: --num-requests requests of 512 prompt + 256 output tokens submitted at once;
  - one 8,192-token prefill (with --max-model-len above 8192) against its matmul time.

    python bench/gpu_offline.py --shapes qwen2.5-1.5b llama-3.1-8b
    python bench/gpu_offline.py --shapes qwen2.5-1.5b --parts floor decode     # decode only, a minute

Prints one JSON line per shape, writes gpu_offline.json into --out, and prints a short table last.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time

import torch

from specserve import LLM, SamplingParams
from specserve.model.shapes import SHAPES

PARTS = ("floor", "decode", "transformers", "throughput", "prefill")


def copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    a = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    secs = start.elapsed_time(end) / 1e3 / 10
    del a, b
    return 2 * num_bytes / secs


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 20 / (time.perf_counter() - t)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def specserve_decode(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    """ms per decode step with `batch` sequences (timed after every prefill finished). Progress is read
    from the scheduler's requests: an offline engine (stream_outputs False) returns finished requests only."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, prompt_len, eng.vocab_size, seed=batch)):
        eng.add_request(f"d{batch}-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    reqs = list(eng.scheduler.requests.values())
    while any(r.num_output_tokens + r.num_pending_tokens == 0 for r in reqs):
        eng.step()
    # The timed loop produces the rest, one decode step each (with asynchronous scheduling one more
    # token may already be in flight, counted as pending).
    done = min(r.num_output_tokens + r.num_pending_tokens for r in reqs)
    torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / max(1, new_tokens - done) * 1e3


def specserve_throughput(llm: LLM, num: int, prompt_len: int, out_len: int) -> float:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    prompts = _prompts(num, prompt_len, eng.vocab_size, seed=7)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"t{i}", {"prompt_token_ids": p}, params)
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    return num * out_len / (time.perf_counter() - t)


def specserve_prefill(llm: LLM, length: int) -> float:
    eng = llm.engine
    warm, p = _prompts(2, length, eng.vocab_size, seed=3)  # two prompts: no prefix-cache hit
    eng.add_request("prefill-warm", {"prompt_token_ids": warm[:512]}, SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.add_request("prefill", {"prompt_token_ids": p}, SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def num_gpu_blocks(llm: LLM) -> int | None:
    for m in llm.get_metrics():
        if m.name.endswith("cache_config_info"):
            return int(m.labels["num_gpu_blocks"])
    return None


def transformers_runs(shape: str, prompt_len: int, new_tokens: int, batch: int) -> dict[str, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = dict(SHAPES[shape])
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    res = {}
    vocab = cfg.vocab_size
    ids = torch.tensor(_prompts(1, prompt_len, vocab, 1), device="cuda")

    def step_ms(inp, n, **kw) -> float:
        """Median ms between consecutive decode steps, timestamped by a stopping criterion."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **_):
                torch.cuda.synchronize()
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        model.generate(
            inp,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Stamp()]),
            **kw,
        )
        gaps = sorted(b - a for a, b in zip(stamps[1:], stamps[2:]))
        return gaps[len(gaps) // 2] * 1e3

    step_ms(ids, new_tokens, cache_implementation="static")  # warm up (and compile, if it does)
    res["hf_static_b1_ms_per_step"] = step_ms(ids, new_tokens, cache_implementation="static")
    ids_b = torch.tensor(_prompts(batch, 128, vocab, 2), device="cuda")
    step_ms(ids_b, 16)
    res[f"hf_dynamic_b{batch}_tok_s"] = batch / step_ms(ids_b, new_tokens) * 1e3
    return res  # the model is freed with this frame (the caller collects)


def _guard(res: dict, name: str, fn) -> None:
    """Run one measurement; a failure is recorded and printed, the rest still runs."""
    import traceback

    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a benchmark reports failures, it does not stop
        traceback.print_exc()
        res[f"{name}_error"] = repr(e)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run_shape(shape: str, args: argparse.Namespace, bw: float, mm: float) -> dict:
    from specserve.model.arch import ModelArch

    arch = ModelArch.from_hf_config(SHAPES[shape])
    weight_bytes = arch.num_params() * 2
    res: dict = {"shape": shape, "weight_bytes": weight_bytes, "floor_ms": weight_bytes / bw * 1e3}
    if "transformers" in args.parts:
        _guard(res, "transformers", lambda: res.update(transformers_runs(shape, 128, args.new_tokens, 32)))
        _free()
    t = time.perf_counter()
    llm = LLM(
        model=shape,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=0.85,
        progress=False,
    )
    res["engine_init_s"] = time.perf_counter() - t
    res["num_gpu_blocks"] = num_gpu_blocks(llm)

    def decode() -> None:
        specserve_decode(llm, 1, 128, 16)  # warm up
        res["b1_ms_per_step"] = specserve_decode(llm, 1, 128, args.new_tokens)
        res["b32_ms_per_step"] = specserve_decode(llm, 32, 128, args.new_tokens)

    def prefill() -> None:
        linear = arch.num_params() - arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
        res["prefill_8192_ms"] = specserve_prefill(llm, 8192)
        res["prefill_matmul_ms"] = 2 * linear * 8192 / mm * 1e3

    if "decode" in args.parts:
        _guard(res, "decode", decode)
    if "throughput" in args.parts:
        _guard(
            res,
            "throughput",
            lambda: res.update(throughput_tok_s=specserve_throughput(llm, args.num_requests, 512, 256)),
        )
    if "prefill" in args.parts and args.max_model_len > 8192:
        _guard(res, "prefill", prefill)
    llm.engine.shutdown()
    return res  # the engine is freed with this frame (the caller collects)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b"], help="model shape names (dummy weights)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="what to measure")
    ap.add_argument("--new-tokens", type=int, default=256, help="new tokens per decode measurement")
    ap.add_argument("--num-requests", type=int, default=1000, help="requests of the throughput part")
    ap.add_argument("--max-model-len", type=int, default=4096, help="above 8192 adds the prefill part")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine's running batch cap")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's token budget per step")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory of gpu_offline.json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    mm = matmul_rate() if "prefill" in args.parts else float("nan")
    results = {
        "copy_bandwidth_GBs": bw / 1e9,
        "bf16_matmul_TFLOPs": mm / 1e12,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": [],
    }
    for shape in args.shapes:
        results["shapes"].append(run_shape(shape, args, bw, mm))
        _free()
        print(json.dumps(results["shapes"][-1]), flush=True)
    with open(os.path.join(args.out, "gpu_offline.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_table(results)


def print_table(results: dict) -> None:
    print(
        f"\ncopy bandwidth {results['copy_bandwidth_GBs']:.0f} GB/s; "
        f"bf16 matmul {results['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
    )
    print(
        f"{'shape':14} {'floor ms':>8} {'b1 ms':>7} {'%floor':>6} {'HF b1 ms':>8} {'vs HF':>6} {'b32 ms':>7} "
        f"{'tput tok/s':>10} {'HF b32 tok/s':>12} {'ratio':>6} {'prefill ms':>10} {'mm ms':>6}"
    )
    for r in results["shapes"]:
        b1, hf = r.get("b1_ms_per_step", float("nan")), r.get("hf_static_b1_ms_per_step", float("nan"))
        tput, hf32 = r.get("throughput_tok_s", float("nan")), r.get("hf_dynamic_b32_tok_s", float("nan"))
        print(
            f"{r['shape']:14} {r['floor_ms']:8.3f} {b1:7.3f} {100 * r['floor_ms'] / b1:5.1f}% {hf:8.3f} "
            f"{hf / b1:5.2f}x {r.get('b32_ms_per_step', float('nan')):7.3f} {tput:10.0f} {hf32:12.0f} "
            f"{tput / hf32:5.1f}x {r.get('prefill_8192_ms', float('nan')):10.1f} "
            f"{r.get('prefill_matmul_ms', float('nan')):6.1f}"
        )


if __name__ == "__main__":
    main()
