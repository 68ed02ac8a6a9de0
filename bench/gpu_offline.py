"""Offline GPU benchmark (H200): specserve vs transformers on dummy shapes, against the bandwidth floor.

One run measures, side by side:
  - device-to-device copy bandwidth -> decode floor = weight bytes / bandwidth;
  - bf16 matmul rate (8192^3) -> prefill matmul time;
  - specserve batch-1 and batch-32 decode ms/step (128-token prompt, 256 new tokens), end to end
    through Engine.step (scheduling, sampling, detokenization-free token ids);
  - transformers static-cache batch-1 decode and dynamic-cache batch-32 throughput, same shapes;
  - offline throughput: N requests of 512 prompt + 256 output tokens submitted at once;
  - one 8,192-token prefill (optional) against its matmul time;
  - logits relative error of the Triton + CUDA-graph path against the torch reference path.
Prints a table last and writes JSON to $OUT (or --out).

usage: python bench/gpu_offline.py --shapes qwen2.5-1.5b llama-3.1-8b [--parts ...] [--num-requests 1000]
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

PARTS = ("floor", "decode", "transformers", "throughput", "prefill", "accuracy")


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
    return 2 * n ** 3 * 20 / (time.perf_counter() - t)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def specserve_decode(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    """ms per decode step with `batch` sequences (timed after every prefill finished)."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, prompt_len, eng.vocab_size, seed=batch)):
        eng.add_request(f"d{batch}-{i}", {"prompt_token_ids": p}, params)
    while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
        eng.step()
    # Tokens sampled already (with asynchronous scheduling one may still be in flight): the timed
    # loop produces the rest, one decode step each.
    done = min(r.num_output_tokens + r.num_pending_tokens for r in eng.scheduler.requests.values())
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
    (p,) = _prompts(1, length, eng.vocab_size, seed=3)
    eng.add_request("prefill-warm", {"prompt_token_ids": p[:512]}, SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    eng.kv.reset_prefix_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.add_request("prefill", {"prompt_token_ids": p}, SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def logits_error(llm: LLM, length: int = 200) -> float:
    """‖triton - torch_ref‖/‖torch_ref‖ of the logits of every position of one prefill (bf16 both)."""
    from specserve.attention.torch_ref import TorchRefBackend
    from specserve.kv.manager import KVCacheManager
    from specserve.runner.model_runner import ModelRunner
    from specserve.scheduler.request import Request
    from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput

    eng = llm.engine
    (p,) = _prompts(1, length, eng.vocab_size, seed=11)
    logits = []
    for backend in (eng.runner.backend, TorchRefBackend()):
        runner = ModelRunner(eng.loaded, eng.runner.spec, 32, eng.device, backend)
        kv = KVCacheManager(32, eng.kv.block_size, False)
        # Score every position: the prompt's tail poses as draft tokens under verification.
        req = Request("acc", p[:1], SamplingParams(max_tokens=1), 1)
        req.spec_token_ids = p[1:]
        kv.allocate_slots(req, length)
        sched = SchedulerOutput([ScheduledRequest(req, length, length - 1)], length)
        logits.append(runner.execute(sched, kv.block_ids).logits.float())
        del runner
    fast, ref = logits
    return float((fast - ref).norm() / ref.norm())


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

        model.generate(inp, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                       stopping_criteria=StoppingCriteriaList([Stamp()]), **kw)
        gaps = sorted(b - a for a, b in zip(stamps[1:], stamps[2:]))
        return gaps[len(gaps) // 2] * 1e3

    step_ms(ids, new_tokens, cache_implementation="static")  # warm up (and compile, if it does)
    res["hf_static_b1_ms_per_step"] = step_ms(ids, new_tokens, cache_implementation="static")
    ids_b = torch.tensor(_prompts(batch, 128, vocab, 2), device="cuda")
    step_ms(ids_b, 16)
    res[f"hf_dynamic_b{batch}_tok_s"] = batch / step_ms(ids_b, new_tokens) * 1e3
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _guard(res: dict, name: str, fn) -> None:
    """Run one measurement; a failure is recorded and printed, the rest still runs."""
    import traceback

    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a benchmark reports failures, it does not stop
        traceback.print_exc()
        res[f"{name}_error"] = repr(e)


def run_shape(shape: str, args: argparse.Namespace, bw: float, mm: float) -> dict:
    from specserve.model.arch import ModelArch

    arch = ModelArch.from_hf_config(SHAPES[shape])
    weight_bytes = arch.num_params() * 2
    res: dict = {"shape": shape, "weight_bytes": weight_bytes, "floor_ms": weight_bytes / bw * 1e3}
    if "transformers" in args.parts:
        _guard(res, "transformers", lambda: res.update(transformers_runs(shape, 128, args.new_tokens, 32)))
    t = time.perf_counter()
    llm = LLM(model=shape, load_format="dummy", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.85,
              progress=False)
    res["engine_init_s"] = time.perf_counter() - t
    res["num_gpu_blocks"] = llm.engine.kv.num_blocks

    def decode() -> None:
        specserve_decode(llm, 1, 128, 16)  # warm up
        res["async_scheduling"] = llm.engine.async_scheduling
        res["b1_ms_per_step"] = specserve_decode(llm, 1, 128, args.new_tokens)
        res["b32_ms_per_step"] = specserve_decode(llm, 32, 128, args.new_tokens)
        # The same engine stepping synchronously (the flag is read per step), for the comparison.
        mode, llm.engine.async_scheduling = llm.engine.async_scheduling, False
        res["sync_b1_ms_per_step"] = specserve_decode(llm, 1, 128, args.new_tokens)
        res["sync_b32_ms_per_step"] = specserve_decode(llm, 32, 128, args.new_tokens)
        llm.engine.async_scheduling = mode

    def prefill() -> None:
        linear = arch.num_params() - arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
        res["prefill_8192_ms"] = specserve_prefill(llm, 8192)
        res["prefill_matmul_ms"] = 2 * linear * 8192 / mm * 1e3

    if "decode" in args.parts:
        _guard(res, "decode", decode)
    if "throughput" in args.parts:
        _guard(res, "throughput", lambda: res.update(throughput_tok_s=specserve_throughput(
            llm, args.num_requests, 512, 256)))
    if "prefill" in args.parts and args.max_model_len > 8192:
        _guard(res, "prefill", prefill)
    if "accuracy" in args.parts:
        _guard(res, "accuracy", lambda: res.update(logits_rel_err=logits_error(llm)))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b"])
    ap.add_argument("--parts", nargs="+", default=list(PARTS))
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    bw = copy_bandwidth()
    mm = matmul_rate() if "prefill" in args.parts else float("nan")
    results = {"copy_bandwidth_GBs": bw / 1e9, "bf16_matmul_TFLOPs": mm / 1e12, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "shapes": []}
    for shape in args.shapes:
        results["shapes"].append(run_shape(shape, args, bw, mm))
        print(json.dumps(results["shapes"][-1]), flush=True)
    with open(os.path.join(args.out, "gpu_offline.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_table(results)


def print_table(results: dict) -> None:
    print(f"\ncopy bandwidth {results['copy_bandwidth_GBs']:.0f} GB/s; bf16 matmul {results['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    for r in results["shapes"]:
        if "sync_b1_ms_per_step" in r:
            print(f"{r['shape']}: synchronous scheduling b1 {r['sync_b1_ms_per_step']:.3f} ms "
                  f"({100 * r['floor_ms'] / r['sync_b1_ms_per_step']:.1f}% of floor), "
                  f"b32 {r['sync_b32_ms_per_step']:.3f} ms")
    print(f"{'shape':14} {'floor ms':>8} {'b1 ms':>7} {'%floor':>6} {'HF b1 ms':>8} {'vs HF':>6} {'b32 ms':>7} "
          f"{'tput tok/s':>10} {'HF b32 tok/s':>12} {'ratio':>6} {'prefill ms':>10} {'mm ms':>6} {'logit err':>9}")
    for r in results["shapes"]:
        b1, hf = r.get("b1_ms_per_step", float("nan")), r.get("hf_static_b1_ms_per_step", float("nan"))
        tput, hf32 = r.get("throughput_tok_s", float("nan")), r.get("hf_dynamic_b32_tok_s", float("nan"))
        print(f"{r['shape']:14} {r['floor_ms']:8.3f} {b1:7.3f} {100 * r['floor_ms'] / b1:5.1f}% {hf:8.3f} "
              f"{hf / b1:5.2f}x {r.get('b32_ms_per_step', float('nan')):7.3f} {tput:10.0f} {hf32:12.0f} "
              f"{tput / hf32:5.1f}x {r.get('prefill_8192_ms', float('nan')):10.1f} "
              f"{r.get('prefill_matmul_ms', float('nan')):6.1f} {r.get('logits_rel_err', float('nan')):9.2e}")


if __name__ == "__main__":
    main()
