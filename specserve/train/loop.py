"""`specserve train-draft`: train an EAGLE-3, P-EAGLE or EAGLE head for a target by self-distillation."""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specserve.speculative.proposers.eagle_head import EagleHead, head_config_for, save_head, target_lm_weight
from specserve.speculative.proposers.head_formats import head_state
from specserve.train import data as train_data
from specserve.train.loss import head_loss
from specserve.train.target import target_batch

STATE_NAME, DATA_NAME = "train_state.pt", "distill.jsonl"
DEFAULT_DRAFT_VOCAB = 32768


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve train-draft", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target model: catalog name, HF dir or .gguf file")
    p.add_argument("--method", required=True, choices=("eagle3", "p-eagle"))
    p.add_argument("--eagle", action="store_true", help="EAGLE-1 features (last hidden state) instead of EAGLE-3's")
    p.add_argument("--out", required=True, help="output dir (config.json + model.safetensors)")
    p.add_argument("--data", help="JSONL: prompt | messages (answered by the target) | text | token_ids")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps in all (default: until the time budget)")
    p.add_argument("--time-budget-s", type=float, default=None, help="seconds for answering + training")
    p.add_argument("--num-prompts", type=int, default=512, help="stdlib prompts to self-distill (no --data)")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=1024, help="longest training sequence (prompt + answer)")
    p.add_argument("--max-model-len", type=int, default=None, help="the target engine's context (default: max-seq-len)")
    p.add_argument("--temperature", type=float, default=0.0, help="of the target's answers")
    p.add_argument("--gen-fraction", type=float, default=0.4, help="share of the time budget for answering")
    p.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per step (8192 GPU, 1024 CPU)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hard-label-weight", type=float, default=0.5, help="loss share on the target's argmax")
    vocab_help = f"tokens the head may propose (default {DEFAULT_DRAFT_VOCAB}; 0 = the full vocabulary)"
    p.add_argument("--draft-vocab-size", type=int, default=None, help=vocab_help)
    p.add_argument("--ttt-steps", type=int, default=3, help="eagle3/eagle: blocks of training-time test")
    p.add_argument("--num-mask-slots", type=int, default=5, help="p-eagle: mask slots (drafts k <= slots + 1)")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", help="dummy: random target weights of a shape name (smoke tests)")
    p.add_argument("--init-from", help="start from this head dir's weights (e.g. p-eagle from an eagle3 head)")
    p.add_argument("--no-train-state", action="store_true", help="write the head only (not resumable)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


@dataclass
class TrainResult:
    out: Path
    steps: int
    num_sequences: int
    metrics: dict[str, float]


def _needs_generation(args) -> bool:
    if args.resume and (Path(args.out) / DATA_NAME).is_file():
        return False
    return not args.data or any(e.messages is not None for e in train_data.load_jsonl(args.data))


def _load_target(args, device: torch.device, generate: bool):
    """A specserve LLM of the target (small when it answers no prompts: only its model and tokenizer are used)."""
    from specserve import LLM

    max_len = args.max_model_len or args.max_seq_len  # the RoPE table must reach the longest sequence
    fmt = args.load_format
    kw = dict(model=args.target, device=device.type, max_model_len=max_len, progress=not args.quiet, load_format=fmt)
    if not generate:
        # Only the model and tokenizer are used: a KV pool of one float32 sequence.
        kv_bytes = _one_sequence_kv_bytes(args.target, fmt, max_len)
        kw.update(kv_cache_memory_bytes=kv_bytes, max_num_seqs=1, enforce_eager=True)
    elif device.type == "cuda":
        kw.update(gpu_memory_utilization=0.45, max_num_seqs=256)  # the rest is for training after
    else:
        kw.update(max_num_seqs=32)
    return LLM(**kw)


def _one_sequence_kv_bytes(target: str, load_format: str, max_len: int, block: int = 16) -> int:
    """KV bytes of one float32 sequence of max_len tokens (rounded up to blocks, one block spare)."""
    from specserve.config import ModelConfig
    from specserve.model.arch import ModelArch
    from specserve.model.loader import WeightSource

    arch = ModelArch.from_hf_config(WeightSource.open(ModelConfig(model=target, load_format=load_format)).hf_config)
    per_token = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4
    return (-(-max_len // block) + 1) * block * per_token


def prepare_data(args, llm, deadline: float) -> list[train_data.TrainSeq]:
    out = Path(args.out)
    cached = out / DATA_NAME
    if args.resume and cached.is_file():
        return [train_data.TrainSeq(e.token_ids, e.num_prompt_tokens) for e in train_data.load_jsonl(cached)]
    examples = (
        train_data.load_jsonl(args.data) if args.data else train_data.stdlib_examples(args.num_prompts, args.seed)
    )
    if args.data:
        train_data.check_vocab(examples, llm.engine.vocab_size, args.data)
    seqs = train_data.build_sequences(
        llm, examples, args.max_new_tokens, args.max_seq_len, args.temperature, deadline, args.seed, not args.quiet
    )
    if not seqs:
        raise ValueError("no training sequences: the data was empty or the time budget ran out first.")
    out.mkdir(parents=True, exist_ok=True)
    train_data.save_sequences(cached, seqs)
    return seqs


def _draft_vocab_size(args, vocab_size: int) -> int | None:
    """--draft-vocab-size resolved: None = the full vocabulary."""
    n = DEFAULT_DRAFT_VOCAB if args.draft_vocab_size is None else args.draft_vocab_size
    if n < 0:
        raise ValueError(f"--draft-vocab-size must be >= 0 (0 = the full vocabulary), got {n}.")
    return None if n == 0 or n >= vocab_size else n


def _special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens (EOS, chat-template markers), which a draft vocabulary keeps."""
    if tokenizer is None:
        return set()
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", False))
    return {int(i) for i in ids}


def build_draft_vocab(args, loaded, seqs: list[train_data.TrainSeq]) -> train_data.DraftVocab | None:
    """The head's d2t from the training data, or None for a full-vocabulary head."""
    size = _draft_vocab_size(args, loaded.arch.vocab_size)
    if size is None:
        return None
    vocab = train_data.draft_vocab(seqs, loaded.arch.vocab_size, size, _special_ids(loaded.tokenizer))
    if not args.quiet:
        print(
            f"draft vocabulary: {size} of {loaded.arch.vocab_size} tokens, covering "
            f"{100 * vocab.answer_coverage:.2f}% of the answer tokens",
            file=sys.stderr,
        )
    return vocab


def _new_head(args, loaded, device: torch.device, d2t: list[int] | None = None) -> EagleHead:
    method = "eagle" if args.eagle else "eagle3"
    slots = args.num_mask_slots if args.method == "p-eagle" else 0
    cfg = head_config_for(
        loaded.arch, loaded.hf_config, loaded.name, loaded.identity, method, slots, None if d2t is None else len(d2t)
    )
    if method == "eagle3":  # the architecture vLLM and SGLang run; P-EAGLE's mask rows embed the last token id
        cfg = replace(cfg, flavour="published", mask_token_id=loaded.arch.vocab_size - 1 if slots else None)
    torch.manual_seed(args.seed)
    head = EagleHead(cfg)
    if d2t is not None:
        head.set_draft_vocab(torch.tensor(d2t, dtype=torch.int64))
    if head.published:  # the LM head starts as the target's rows of the draft vocabulary
        lm = target_lm_weight(loaded.model).detach()
        head.lm_head.weight.data.copy_(lm if head.d2t is None else lm.index_select(0, head.d2t.to(lm.device)))
    if args.init_from:
        _init_from_head(head, args.init_from)
    head = head.to(device=device, dtype=torch.float32)
    if head.published:
        head.attach_target(loaded.model)  # P-EAGLE: its mask token's embedding
    return head


def _init_from_head(head: EagleHead, path: str) -> None:
    """Copy every same-shaped tensor of another head but d2t (e.g. a P-EAGLE head from an EAGLE-3 head)."""
    state = head_state(path, head)
    own = head.state_dict()
    same = {k: v for k, v in state.items() if k in own and k != "d2t" and tuple(v.shape) == tuple(own[k].shape)}
    if not same:
        raise ValueError(f"--init-from {path}: no tensor matches this head.")
    head.load_state_dict(same, strict=False)


def _lr_factor(progress: float, step: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def run_training(args) -> TrainResult:
    """The whole command: answer the prompts with the target, then train the head."""
    budget = args.time_budget_s if args.time_budget_s is not None else float("inf")
    if args.steps is None and args.time_budget_s is None:
        raise ValueError("give --steps, --time-budget-s or both.")
    from specserve.engine.setup import resolve_device

    device = resolve_device(args.device)
    if args.data:
        train_data.refuse_humaneval(args.data)
    if not args.resume and (Path(args.out) / "model.safetensors").is_file():
        print(f"specserve train-draft: overwriting the head in {args.out} (--resume continues it)", file=sys.stderr)
    llm = _load_target(args, device, _needs_generation(args))
    loaded = llm.engine.loaded
    start = time.monotonic()  # the budget covers answering + training, not loading the target
    seqs = prepare_data(args, llm, start + budget * args.gen_fraction)
    del llm  # the engine's KV pool goes; the model stays (held by `loaded`)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    vocab = build_draft_vocab(args, loaded, seqs)
    head = _new_head(args, loaded, device, None if vocab is None else vocab.token_ids)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = _maybe_resume(args, head, opt, device)
    deadline = start + budget - 5.0  # leave time for the final checkpoint
    progress = {"step": step, "metrics": {}}
    try:
        _train_loop(args, head, opt, loaded.model, seqs, progress, device, deadline)
    except BaseException:
        if progress["step"] > step:  # keep what was trained (a GPU run must not end with nothing)
            _save(args, head, opt, progress["step"], progress["metrics"], seqs)
        raise
    _save(args, head, opt, progress["step"], progress["metrics"], seqs)
    return TrainResult(Path(args.out), progress["step"], len(seqs), progress["metrics"])


def _train_loop(args, head: EagleHead, opt, target, seqs: list, progress: dict, device: torch.device, deadline: float):
    """Trains until --steps or the deadline; progress holds the step and the last metrics (read at reports)."""
    step = progress["step"]
    parallel = args.method == "p-eagle"
    num_blocks = 1 + (args.num_mask_slots if parallel else args.ttt_steps - 1)
    hard = args.hard_label_weight
    batch_tokens = args.batch_tokens or (8192 if device.type == "cuda" else 1024)
    base_batches = train_data.make_batches([len(s.token_ids) for s in seqs], batch_tokens, random.Random(args.seed))
    warmup = 30 if args.steps is None else max(1, min(30, args.steps // 10))
    train_start = time.monotonic()
    recent: list[tuple[list[str], torch.Tensor]] = []  # the last METRIC_WINDOW steps' (names, values)
    bar = tqdm(total=args.steps, initial=step, desc=f"train {args.method}", disable=args.quiet)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    while (args.steps is None or step < args.steps) and time.monotonic() < deadline:
        # Seeded order per epoch: a resumed run sees what the uninterrupted one would.
        epoch, index = divmod(step, len(base_batches))
        order = list(range(len(base_batches)))
        random.Random(args.seed * 1000 + epoch).shuffle(order)
        batch = [seqs[i] for i in base_batches[order[index]]]
        starts = [max(0, s.num_prompt_tokens - 2) for s in batch]
        frac = step / args.steps if args.steps else (time.monotonic() - train_start) / max(1.0, deadline - train_start)
        for g in opt.param_groups:
            g["lr"] = args.lr * _lr_factor(frac, step, warmup)
        tb = target_batch(target, [s.token_ids for s in batch], head.cfg.aux_hidden_layers, device, head.d2t)
        with autocast:
            lengths = [len(s.token_ids) for s in batch]
            loss, accs = head_loss(
                head, target, tb.ids, lengths, starts, tb.feats, tb.probs, tb.last, num_blocks, parallel, hard, tb.top
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        del tb  # the next step's target forward need not share memory with it
        step += 1
        recent.append(
            (["loss", *(f"acc{i + 1}" for i in range(len(accs)))], torch.stack([loss.detach().float(), *accs]))
        )
        del recent[:-METRIC_WINDOW]
        progress["step"] = step
        bar.update(1)
        if step % REPORT_EVERY == 0 or step % args.save_every == 0:
            progress["metrics"] = _metrics(recent)
            bar.set_postfix(progress["metrics"])
        if step % args.save_every == 0:
            _save(args, head, opt, step, progress["metrics"])
    if recent:
        progress["metrics"] = _metrics(recent)
    bar.close()


REPORT_EVERY, METRIC_WINDOW = 10, 20


def _metrics(recent: list[tuple[list[str], torch.Tensor]]) -> dict[str, float]:
    """Means over the recent steps, read in one copy (the names are the last step's)."""
    values = torch.cat([v for _, v in recent]).tolist()
    sums: dict[str, float] = {}
    i = 0
    for names, _ in recent:
        for name, x in zip(names, values[i : i + len(names)]):
            sums[name] = sums.get(name, 0.0) + x
        i += len(names)
    return {k: round(sums[k] / len(recent), 4) for k in recent[-1][0]}


TRAINING_NAME = "training.json"


def _provenance(args, step: int, metrics: dict, seqs: list[train_data.TrainSeq]) -> dict:
    """What the head was trained from, for whoever serves it later (not read back by specserve)."""
    return {
        "method": args.method,
        "target": args.target,
        "steps": step,
        "data": str(Path(args.data).resolve()) if args.data else "stdlib self-distillation",
        "num_sequences": len(seqs),
        "num_tokens": sum(len(s.token_ids) for s in seqs),
        "num_answer_tokens": sum(len(s.token_ids) - s.num_prompt_tokens for s in seqs),
        "metrics": metrics,
    }


def _save(args, head: EagleHead, opt, step: int, metrics: dict, seqs: list[train_data.TrainSeq] | None = None) -> None:
    save_head(head, args.out)
    if seqs is not None:
        tmp = Path(args.out) / (TRAINING_NAME + ".tmp")
        tmp.write_text(json.dumps(_provenance(args, step, metrics, seqs), indent=2) + "\n")
        tmp.replace(Path(args.out) / TRAINING_NAME)
    if args.no_train_state:
        return
    tmp = Path(args.out) / (STATE_NAME + ".tmp")
    state = dict(step=step, optimizer=opt.state_dict(), metrics=metrics, method=args.method, eagle=args.eagle)
    torch.save({**state, "draft_vocab_size": head.cfg.draft_vocab_size}, tmp)
    tmp.replace(Path(args.out) / STATE_NAME)


def _maybe_resume(args, head: EagleHead, opt, device: torch.device) -> int:
    state_path = Path(args.out) / STATE_NAME
    if not args.resume or not state_path.is_file():
        return 0
    state = torch.load(state_path, map_location=device, weights_only=False)
    if state.get("method") != args.method or state.get("eagle") != args.eagle:
        raise ValueError(f"{args.out} holds a {state.get('method')} run; cannot resume it as {args.method}.")
    if state.get("draft_vocab_size") != head.cfg.draft_vocab_size:
        have, want = state.get("draft_vocab_size") or "full", head.cfg.draft_vocab_size or "full"
        raise ValueError(
            f"{args.out} holds a run with draft vocabulary {have}, this one has {want}: "
            "resume with the same --draft-vocab-size (0 = full)."
        )
    head.load_state_dict({k: v.to(device) for k, v in head_state(args.out, head).items()})
    opt.load_state_dict(state["optimizer"])
    return int(state["step"])


def train_main(argv: list[str]) -> int:
    """Entry point of `specserve train-draft`; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        result = run_training(args)
    except ValueError as e:
        print(f"specserve train-draft: {e}", file=sys.stderr)
        return 2
    print(f"wrote {result.out} after {result.steps} steps on {result.num_sequences} sequences: {result.metrics}")
    return 0


if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:]))
