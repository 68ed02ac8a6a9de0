"""EAGLE head: config, paged vs dense attention, training rows == serving rows, and the trainer."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.attention.torch_ref import TorchRefBackend
from specserve.kv.spec import KVCacheSpec, kv_format
from specserve.model.arch import ModelArch, rope_cos_sin_cache
from specserve.speculative.proposers.eagle_graph import PinnedUpload, attention_arrays, attention_metadata
from specserve.speculative.proposers.eagle_head import (
    EagleHead,
    default_aux_layers,
    head_config_for,
    read_head_config,
    save_head,
)
from specserve.train.loop import train_main
from specserve.train.loss import _block_mask, head_block_outputs
from tests.helpers.eagle_heads import make_random_head_dir

HF = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 6,
    "vocab_size": 50,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128,
}


def _head(method: str = "eagle3", slots: int = 0, seed: int = 0) -> tuple[EagleHead, types.SimpleNamespace]:
    arch = ModelArch.from_hf_config(HF)
    torch.manual_seed(seed)
    head = EagleHead(head_config_for(arch, HF, "t", "id", method, slots))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    target = types.SimpleNamespace(
        embed_tokens=torch.nn.Embedding(50, 32), cos_sin_cache=rope_cos_sin_cache(arch, 128, torch.device("cpu"))
    )
    return head.eval(), target


def test_default_aux_layers():
    assert default_aux_layers(28) == (2, 14, 25)  # Qwen2.5-1.5B: low, middle, high
    assert default_aux_layers(30) == (2, 15, 27)
    assert default_aux_layers(2) == (0, 1)
    assert default_aux_layers(1) == (0,)


def test_config_round_trip(tmp_path):
    head, _ = _head("eagle3", slots=3)
    save_head(head, tmp_path / "h")
    cfg = read_head_config(tmp_path / "h")
    assert cfg == head.cfg
    assert cfg.aux_hidden_layers == (2, 3) and cfg.num_mask_slots == 3
    assert json.loads((tmp_path / "h" / "config.json").read_text())["target"]["num_layers"] == 6


class _Paged:
    """Serving-side emulation: the head's rows go through the paged cache like eagle.py's."""

    def __init__(self, head: EagleHead, target, blocks: int = 8, block_size: int = 4) -> None:
        arch = head.cfg.layer_arch()
        spec = KVCacheSpec(1, arch.num_kv_heads, arch.head_dim, block_size, kv_format("auto", torch.float32))
        self.cache, self.fmt, self.bs = spec.allocate(blocks, torch.device("cpu"))[0], spec.fmt, block_size
        self.head, self.target, self.scale = head, target, arch.head_dim**-0.5
        self.table = list(reversed(range(blocks)))  # scattered blocks on purpose
        self.rows = 0

    def __call__(self, embeds, hidden, positions: list[int]):
        arrays = attention_arrays([self.rows], [len(positions)], [self.table], self.bs)
        meta = attention_metadata(arrays, PinnedUpload(torch.device("cpu"), slots=1).send(arrays), [len(positions)])

        def attend(q, k, v):
            return TorchRefBackend().forward(q, k, v, self.cache, self.fmt, meta, self.scale)

        self.rows += len(positions)
        return self.head(embeds, hidden, torch.tensor(positions), self.target.cos_sin_cache, attend)


@torch.no_grad()
def test_paged_rows_in_chunks_equal_dense_causal_rows():
    head, target = _head("eagle3")
    T = 13
    embeds = torch.randn(T, 32)
    ids = torch.zeros(1, T + 1, dtype=torch.long)
    feats = torch.randn(1, T + 1, 64)
    dense = head_block_outputs(
        head,
        types.SimpleNamespace(embed_tokens=lambda x: embeds.view(1, T, 32), cos_sin_cache=target.cos_sin_cache),
        ids,
        feats,
        1,
        False,
    )[0][0]
    paged = _Paged(head, target)
    fused = head.fuse_target(feats[0, :T])
    first = paged(embeds[:5], fused[:5], list(range(5)))[0]
    rest = paged(embeds[5:], fused[5:], list(range(5, T)))[0]
    torch.testing.assert_close(torch.cat([first, rest]), dense, rtol=1e-5, atol=1e-5)


def test_block_mask_is_what_drafting_sees():
    m = _block_mask(6, 3, torch.device("cpu")).int()
    # Row 4 of block 3: last real row 2 -> block-1 rows 0..2, its block-2 row 3, itself (block 3 row 4).
    assert m[4].view(3, 6).tolist() == [[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0]]


@pytest.mark.parametrize("parallel", [False, True], ids=["ttt", "p-eagle"])
@torch.no_grad()
def test_training_blocks_equal_serving_drafts(parallel):
    """Row t of training block s == the head's (s-1)-th draft after real rows 0..t-s+1 at serving."""
    S = 3
    head, target = _head("eagle3", slots=S - 1 if parallel else 0, seed=1)
    L = 12
    ids = torch.randint(0, 50, (1, L))
    feats = torch.randn(1, L, 64)
    blocks = head_block_outputs(head, target, ids, feats, S, parallel)
    emb = target.embed_tokens(ids[0])
    fused = head.fuse_target(feats[0])
    for p in (0, 4, L - 1 - S):  # last real row
        paged = _Paged(head, target)
        out, normed = paged(emb[1 : p + 2], fused[: p + 1], list(range(p + 1)))
        torch.testing.assert_close(normed, blocks[0][1][: p + 1], rtol=1e-5, atol=1e-5)
        if parallel:
            me, mh = head.mask_inputs(S - 1)
            paged.rows = p + 1  # the mask rows sit right after the real rows
            _, drafted = paged(me, mh, list(range(p + 1, p + S)))
            for s in range(2, S + 1):
                torch.testing.assert_close(drafted[s - 2], blocks[s - 1][1][p + s - 1], rtol=1e-5, atol=1e-5)
        else:
            prev = out[-1:]
            for s in range(2, S + 1):  # drafting with the true next tokens (what training feeds)
                t = p + s - 1
                prev, normed = paged(emb[t + 1 : t + 2], prev, [t])
                torch.testing.assert_close(normed[0], blocks[s - 1][1][t], rtol=1e-5, atol=1e-5)


def _acceptance(target: str, head: str, prompts: list[list[int]]) -> float:
    llm = LLM(
        model=target,
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False},
    )
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )
    st = llm.engine.stats
    return st.get("spec_decode_num_accepted_tokens_total") / st.get("spec_decode_num_draft_tokens_total")


def test_train_resume_and_beat_a_random_head(tiny_llama_dir, tmp_path):
    out = tmp_path / "head"
    common = [
        "--target",
        str(tiny_llama_dir),
        "--method",
        "eagle3",
        "--out",
        str(out),
        "--max-seq-len",
        "256",
        "--max-new-tokens",
        "40",
        "--num-prompts",
        "12",
        "--batch-tokens",
        "768",
        "--lr",
        "2e-3",
        "--save-every",
        "10",
        "--quiet",
    ]
    assert train_main(common + ["--steps", "20"]) == 0
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 20
    data = (out / "distill.jsonl").read_text()
    first = (out / "model.safetensors").read_bytes()
    assert train_main(common + ["--steps", "36", "--resume"]) == 0
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 36
    assert (out / "distill.jsonl").read_text() == data  # resumed on the same data
    assert (out / "model.safetensors").read_bytes() != first
    rows = [json.loads(line) for line in data.splitlines()]
    assert all(r["num_prompt_tokens"] > 0 for r in rows)
    prompts = [r["token_ids"][: r["num_prompt_tokens"]] for r in rows[:8]]  # the training prompts
    random_head = make_random_head_dir(str(tiny_llama_dir), tmp_path / "random", "eagle3")
    trained, untrained = (
        _acceptance(str(tiny_llama_dir), str(out), prompts),
        _acceptance(str(tiny_llama_dir), str(random_head), prompts),
    )
    assert trained > untrained + 0.05, (trained, untrained)


def test_train_refuses_humaneval(
    tiny_llama_dir, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """HumanEval is refused by the file's name and by a row's content (a copy renamed data.jsonl), before
    anything is written; and only for that: the same prompt in a clean file trains with these flags."""
    tmp_path = tmp_path_factory.mktemp("data")  # tmp_path would be named after this test: "humaneval"
    argv = [
        "--target",
        str(tiny_llama_dir),
        "--method",
        "eagle3",
        "--steps",
        "1",
        "--max-seq-len",
        "128",
        "--max-new-tokens",
        "8",
        "--quiet",
    ]
    prompt = 'def incr_list(l: list):\n    """Return list with elements incremented by 1."""\n'
    fields = {
        "canonical_solution": "    return [e + 1 for e in l]\n",
        "entry_point": "incr_list",
        "test": "def check(candidate):\n    assert candidate([]) == []\n",
    }
    cases = [
        ("HumanEval.jsonl", {"prompt": prompt}, "the path names HumanEval"),
        ("data.jsonl", {"task_id": "HumanEval/42", "prompt": prompt}, "its task_id is 'HumanEval/42'"),
        ("data.jsonl", {"prompt": prompt, **fields}, "it has HumanEval's fields"),
    ]
    for i, (name, row, reason) in enumerate(cases):
        data = tmp_path / str(i) / name
        data.parent.mkdir()
        data.write_text(json.dumps({"text": "a fine line of text"}) + "\n" + json.dumps(row) + "\n")
        assert train_main(argv + ["--out", str(tmp_path / str(i) / "o"), "--data", str(data)]) == 2, name
        err = capsys.readouterr().err
        where = str(data) if name.startswith("HumanEval") else f"{data}:2:"  # the file, and the row's line
        assert where in err and reason in err and "HumanEval is the benchmark" in err, err
        assert not (tmp_path / str(i) / "o").exists()
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"text": "a fine line of text"}) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    assert train_main(argv + ["--out", str(tmp_path / "c"), "--data", str(clean)]) == 0


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
    meta = SamplingMetadata.build(
        params[:VOCAB], [[1, 2]] * VOCAB, [[]] * VOCAB, [None] * VOCAB, len(subset), torch.device("cpu")
    )
    torch.testing.assert_close(q[0, d2t], compute_target_probs(drafter[:1], meta.select_rows([0])).squeeze(0))
    flat = torch.stack([torch.zeros(ROWS, dtype=torch.long), drafts[:, 0], drafts[:, 1]], 1).reshape(-1)
    meta = SamplingMetadata.build(params, [[1, 2]] * ROWS, [[]] * ROWS, [None] * ROWS, VOCAB, torch.device("cpu"))
    out = RejectionSampler(torch.Generator().manual_seed(5))(drafts.tolist(), q, target[flat], meta)
    firsts = np.array([o[:2] for o in out.output_token_ids if len(o) >= 2])
    # Rows that rejected the first draft emitted one token; the joint of the first two needs a
    # second step: for those rows draw it from the target directly (what plain decoding would do).
    single = [i for i, o in enumerate(out.output_token_ids) if len(o) == 1]
    first_only = np.array([out.output_token_ids[i][0] for i in single])
    assert len(single) > 0 and np.isin(first_only, subset, invert=True).any()  # the residual emits outside tokens
    tp = compute_target_probs(
        target,
        SamplingMetadata.build(
            params[:VOCAB], [[1, 2]] * VOCAB, [[]] * VOCAB, [None] * VOCAB, VOCAB, torch.device("cpu")
        ),
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


def test_train_target_without_generation_fits_its_kv_pool(tmp_path):
    """Resuming on cached data (or training on token-id data) loads the target only for its model
    and tokenizer: its KV pool is sized for one max_seq_len sequence, so the engine's start-up check
    (a pool must hold max_model_len) passes. A fixed 4 MiB pool did not hold this target's 8,192
    tokens (512 bytes each), and `train-draft --resume` refused to start on SmolLM2."""
    import argparse

    from specserve.train.loop import _load_target, _one_sequence_kv_bytes
    from tests.helpers.tiny_models import make_tiny_model_dir

    target = str(make_tiny_model_dir(tmp_path / "t", max_position_embeddings=16384, num_layers=4))
    need = _one_sequence_kv_bytes(target, "auto", 16384)
    assert need > 1 << 22  # 4 layers * 2 * 2 KV heads * 16 dims * 4 bytes = 1 KiB per token
    args = argparse.Namespace(target=target, max_model_len=None, max_seq_len=16384, quiet=True, load_format="auto")
    eng = _load_target(args, torch.device("cpu"), generate=False).engine
    assert eng.max_model_len == 16384 and eng.kv.num_blocks * eng.kv.block_size >= 16384
