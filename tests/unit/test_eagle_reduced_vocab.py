"""A reduced draft vocabulary (d2t): round trip, refusals, logits, lossless drafts, training."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model.arch import ModelArch
from specserve.speculative.proposers.eagle_head import (
    EagleHead,
    head_config_for,
    read_head_config,
    save_head,
)
from specserve.train.loop import train_main
from tests.helpers.eagle_heads import TOY_HF as HF
from tests.helpers.eagle_heads import toy_head as _head

# -- a reduced draft vocabulary ----------------------------------------------------------------------
D2T = [0, 3, 4, 9, 17, 18, 25, 31, 40, 49]  # ascending target ids, 10 of the toy's 50


def _reduced_head(method: str = "eagle3", slots: int = 0) -> EagleHead:
    arch = ModelArch.from_hf_config(HF)
    head = EagleHead(head_config_for(arch, HF, "t", "id", method, slots, draft_vocab_size=len(D2T)))
    head.set_draft_vocab(torch.tensor(D2T))
    return head


def _load(path, dtype=torch.float32) -> EagleHead:
    from specserve.speculative.proposers.eagle_head import load_head

    return load_head(path, ModelArch.from_hf_config(HF), "id", torch.device("cpu"), dtype)


def test_reduced_vocab_d2t_round_trip(tmp_path):
    from safetensors.torch import load_file

    head = _reduced_head("eagle3", slots=2)
    save_head(head, tmp_path / "h")
    cfg = read_head_config(tmp_path / "h")
    assert cfg == head.cfg and cfg.draft_vocab_size == len(D2T) and cfg.logits_width == len(D2T)
    stored = load_file(str(tmp_path / "h" / "model.safetensors"))["d2t"]
    assert stored.dtype == torch.int64 and stored.tolist() == D2T
    loaded = _load(tmp_path / "h", torch.bfloat16)
    assert loaded.d2t.dtype == torch.int64 and loaded.d2t.tolist() == D2T  # .to(dtype) leaves ids alone
    assert loaded.layer.qkv_proj.weight.dtype == torch.bfloat16
    # A full-vocabulary head (and a config from before reduced vocabularies) has none.
    full, _ = _head("eagle3")
    save_head(full, tmp_path / "f")
    data = json.loads((tmp_path / "f" / "config.json").read_text())
    assert data["draft_vocab_size"] is None and full.d2t is None and full.cfg.logits_width == 50
    del data["draft_vocab_size"]
    (tmp_path / "f" / "config.json").write_text(json.dumps(data))
    assert read_head_config(tmp_path / "f").draft_vocab_size is None
    assert _load(tmp_path / "f").d2t is None


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.tensor([0, 3, 4, 9, 17, 18, 25, 31, 40, 50]), "outside"),
        (torch.tensor([-1, 3, 4, 9, 17, 18, 25, 31, 40, 49]), "outside"),
        (torch.tensor([0, 3, 4, 9, 17, 17, 25, 31, 40, 49]), "duplicate"),
        (torch.tensor([0, 3, 4, 9, 18, 17, 25, 31, 40, 49]), "ascending"),
        (torch.tensor([0, 3, 4, 9, 17]), "draft_vocab_size"),
        (torch.tensor(D2T, dtype=torch.float32), "integer"),
        (None, "no d2t"),
    ],
    ids=["too-large", "negative", "duplicate", "unsorted", "wrong-size", "float", "missing"],
)
def test_invalid_d2t_refused(tmp_path, bad, match):
    from safetensors.torch import load_file, save_file

    save_head(_reduced_head(), tmp_path / "h")
    path = tmp_path / "h" / "model.safetensors"
    state = load_file(str(path))
    if bad is None:
        del state["d2t"]
    else:
        state["d2t"] = bad
    save_file(state, str(path))
    with pytest.raises(ValueError, match=match):
        _load(tmp_path / "h")


def test_d2t_without_draft_vocab_size_and_bad_sizes_refused(tmp_path):
    save_head(_reduced_head(), tmp_path / "h")
    data = json.loads((tmp_path / "h" / "config.json").read_text())
    for size in (0, 51, -3):
        (tmp_path / "h" / "config.json").write_text(json.dumps({**data, "draft_vocab_size": size}))
        with pytest.raises(ValueError, match="draft_vocab_size"):
            read_head_config(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text(json.dumps({**data, "draft_vocab_size": None}))
    with pytest.raises(ValueError, match="d2t"):
        _load(tmp_path / "h")
    head = _reduced_head()
    with pytest.raises(ValueError, match="duplicate"):
        head.set_draft_vocab(torch.tensor([0, 0, 4, 9, 17, 18, 25, 31, 40, 49]))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        head_config_for(ModelArch.from_hf_config(HF), HF, "t", "id", "eagle3", 0, draft_vocab_size=51)


@torch.no_grad()
def test_reduced_logits_are_the_target_rows_d2t():
    """compute_logits = the full head's columns d2t, from rows gathered once; greedy ids = d2t[argmax],
    which is also the argmax of full logits that are -inf outside d2t (ties included: ascending d2t)."""
    head = _reduced_head().eval()
    lm = torch.randn(50, 32)
    target = types.SimpleNamespace(compute_logits=lambda h: h @ lm.t())
    normed = torch.randn(7, 32)
    with pytest.raises(RuntimeError, match="attach_lm_head"):
        head.compute_logits(normed, target)
    head.attach_lm_head(lm)
    assert head.lm_weight.shape == (len(D2T), 32) and head.lm_weight.dtype == lm.dtype
    d2t = torch.tensor(D2T)
    logits = head.compute_logits(normed, target)
    torch.testing.assert_close(logits, (normed @ lm.t())[:, d2t])
    masked = torch.full((7, 50), float("-inf")).index_copy_(1, d2t, logits)
    assert head.greedy_token_ids(logits).tolist() == masked.argmax(-1).tolist()
    tied = torch.zeros(2, len(D2T))  # every column ties: both pick the lowest target id
    tied_full = torch.full((2, 50), float("-inf")).index_copy_(1, d2t, tied)
    assert head.greedy_token_ids(tied).tolist() == tied_full.argmax(-1).tolist() == [D2T[0]] * 2
    full, _ = _head("eagle3")
    full.attach_lm_head(lm)  # nothing to gather: the target's own logits
    assert full.lm_weight is None
    torch.testing.assert_close(full.compute_logits(normed, target), normed @ lm.t())


# -- sampling with a reduced vocabulary stays lossless ------------------------------------------------
VOCAB, ROWS = 8, 20_000


def _requests(params: list[SamplingParams]) -> list[types.SimpleNamespace]:
    return [
        types.SimpleNamespace(request_id=f"r{i}", params=p, prompt_token_ids=[1, 2], output_token_ids=[])
        for i, p in enumerate(params)
    ]


@pytest.mark.parametrize("filters", [{}, {"temperature": 0.8, "top_k": 3, "top_p": 0.9}], ids=["none", "filtered"])
@torch.no_grad()
def test_reduced_vocab_drafts_keep_verification_lossless(filters):
    """Two drafts per sequence from a Markov toy drafter that knows only `subset` (4 of 8 tokens,
    not the target's first choice), verified against a target that puts mass everywhere: the drafts
    and their distributions stay in the subset, and the joint of the first two emitted tokens is the
    target's (chi-square), tokens outside the subset too."""
    from scipy.stats import chisquare

    from specserve.sample import (
        RejectionSampler,
        SamplingMetadata,
        compute_target_probs,
    )
    from specserve.speculative.proposers.eagle import DraftVocabSampler

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5  # [context, next] logits
    subset = sorted(target[0].argsort(descending=True)[1:5].tolist())
    drafter = target[:, subset] + torch.randn(VOCAB, len(subset), generator=gen)  # [context, draft vocab]
    params = [SamplingParams(seed=None, **filters)] * ROWS
    d2t = torch.tensor(subset)
    sampler = DraftVocabSampler(VOCAB, torch.device("cpu"), d2t)
    sampler.begin(_requests(params))
    rows = list(range(ROWS))
    ctx = torch.zeros(ROWS, dtype=torch.long)
    tokens, probs = [], []
    for _ in range(2):
        t, q = sampler.sample(drafter[ctx], rows)
        tokens.append(t)
        probs.append(q)
        ctx = t
    drafts = torch.stack(tokens, 1)  # [ROWS, 2]
    q = torch.stack(probs, 1).reshape(2 * ROWS, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[d2t] = False
    assert torch.isin(drafts, d2t).all() and not q[:, outside].any()
    torch.testing.assert_close(q.sum(-1), torch.ones(2 * ROWS))
    # The draft's distribution is the request's processing over the draft vocabulary.
    meta = SamplingMetadata.build(params[:VOCAB], [[1, 2]] * VOCAB, [[]] * VOCAB, len(subset), torch.device("cpu"))
    torch.testing.assert_close(q[0, d2t], compute_target_probs(drafter[:1], meta.select_rows([0])).squeeze(0))
    flat = torch.stack([torch.zeros(ROWS, dtype=torch.long), drafts[:, 0], drafts[:, 1]], 1).reshape(-1)
    meta = SamplingMetadata.build(params, [[1, 2]] * ROWS, [[]] * ROWS, VOCAB, torch.device("cpu"))
    out = RejectionSampler(torch.Generator().manual_seed(5))(drafts.tolist(), q, target[flat], meta)
    firsts = np.array([o[:2] for o in out.output_token_ids if len(o) >= 2])
    # Rows that rejected the first draft emitted one token; the joint of the first two needs a
    # second step: for those rows draw it from the target directly (what plain decoding would do).
    single = [i for i, o in enumerate(out.output_token_ids) if len(o) == 1]
    first_only = np.array([out.output_token_ids[i][0] for i in single])
    assert len(single) > 0 and np.isin(first_only, subset, invert=True).any()  # the residual emits outside tokens
    tp = compute_target_probs(
        target,
        SamplingMetadata.build(params[:VOCAB], [[1, 2]] * VOCAB, [[]] * VOCAB, VOCAB, torch.device("cpu")),
    ).double()
    second = torch.multinomial(tp[torch.as_tensor(first_only)].float(), 1, generator=gen)[:, 0].numpy()
    pairs = np.concatenate([firsts, np.stack([first_only, second], 1)])
    joint = (tp[0][:, None] * tp).numpy().ravel()
    counts = np.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    assert counts[joint == 0].sum() == 0
    expected = joint * counts.sum()
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    assert chisquare(obs[exp > 0], exp[exp > 0] * obs[exp > 0].sum() / exp[exp > 0].sum()).pvalue > 1e-3


def test_train_with_a_reduced_draft_vocab(tiny_llama_dir, tiny_llm, tmp_path):
    """train-draft --draft-vocab-size: a couple of steps write a head whose d2t holds the data's
    answer tokens and the special tokens it saw; it loads and drafts losslessly; a resume with
    another vocabulary is refused."""
    from safetensors.torch import load_file

    out = tmp_path / "head"
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    common = [
        "--target",
        str(tiny_llama_dir),
        "--method",
        "p-eagle",
        "--num-mask-slots",
        "2",
        "--out",
        str(out),
        "--max-seq-len",
        "128",
        "--max-new-tokens",
        "16",
        "--num-prompts",
        "4",
        "--batch-tokens",
        "512",
        "--save-every",
        "1",
        "--quiet",
    ]
    assert train_main(common + ["--steps", "2", "--draft-vocab-size", str(vocab // 2)]) == 0
    cfg = read_head_config(out)
    assert cfg.draft_vocab_size == vocab // 2 and cfg.num_mask_slots == 2
    offsets = load_file(str(out / "model.safetensors"))["d2t"].tolist()  # published: target = draft + d2t[draft]
    d2t = [i + o for i, o in enumerate(offsets)]
    assert len(d2t) == vocab // 2 and d2t == sorted(set(d2t))
    rows = [json.loads(line) for line in (out / "distill.jsonl").read_text().splitlines()]
    answers = {t for r in rows for t in r["token_ids"][max(2, r["num_prompt_tokens"]) :]}
    assert answers <= set(d2t)  # fewer distinct answer tokens than the draft vocabulary: all kept
    tok = tiny_llm.get_tokenizer()
    seen = {t for r in rows for t in r["token_ids"]}
    specials = {tok.convert_tokens_to_ids(s) for s in ("<|user|>", "<|assistant|>", "<|end|>")}
    assert specials <= seen and specials <= set(d2t)
    assert train_main(common + ["--steps", "3", "--resume", "--draft-vocab-size", "0"]) == 2
    assert train_main(common + ["--steps", "3", "--resume", "--draft-vocab-size", str(vocab // 2)]) == 0
    prompts = [r["token_ids"][: r["num_prompt_tokens"]] for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={
            "method": "eagle3",
            "model": str(out),
            "num_speculative_tokens": 3,
            "parallel_drafting": True,
            "adaptive": False,
        },
    )
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    plain = [o.outputs[0].token_ids for o in tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == plain
    assert llm.engine.stats.get("spec_decode_num_draft_tokens_total") > 0
