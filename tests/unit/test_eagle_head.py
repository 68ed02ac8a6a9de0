"""EAGLE head: config, paged vs dense attention, training rows == serving rows, and the trainer."""

from __future__ import annotations

import json
import types

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.attention.torch_ref import TorchRefBackend
from specserve.kv.spec import KVCacheSpec, kv_format
from specserve.speculative.proposers.eagle_graph import PinnedUpload, attention_arrays, attention_metadata
from specserve.speculative.proposers.eagle_head import (
    EagleHead,
    default_aux_layers,
    read_head_config,
    save_head,
)
from specserve.train.loop import train_main
from specserve.train.loss import _block_mask, head_block_outputs
from tests.helpers.eagle_heads import make_random_head_dir
from tests.helpers.eagle_heads import toy_head as _head


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
