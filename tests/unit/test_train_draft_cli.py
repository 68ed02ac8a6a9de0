"""`specserve train-draft` end to end on a tiny target: HumanEval rows refused whatever the file is called,
a head trained from the user's own JSONL (every row kind) that serves losslessly, and the progress bars."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.proposers.eagle_head import read_head_config
from specserve.train.data import load_jsonl
from specserve.train.loop import train_main


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"task_id": "HumanEval/0", "prompt": "def f():\n"}, "its task_id is 'HumanEval/0'"),
        ({"task_id": "humaneval-x/python/3", "text": "x"}, "its task_id is"),  # HumanEval-X
        ({"name": "HumanEval_23_strlen", "prompt": "def strlen(s):\n"}, "its name is"),  # MultiPL-E
        (
            {
                "prompt": "def f():\n",
                "canonical_solution": "    pass\n",
                "entry_point": "f",
                "test": "def check(candidate):\n    pass\n",
            },
            "it has HumanEval's fields",
        ),  # a copy without task_id
    ],
    ids=["task_id", "humaneval-x", "multipl-e", "schema"],
)
def test_humaneval_rows_are_refused_under_any_file_name(
    tmp_path_factory: pytest.TempPathFactory, row: dict, reason: str
) -> None:
    # Not tmp_path: it is named after the test, and a path naming HumanEval is refused by that alone.
    data = tmp_path_factory.mktemp("data") / "data.jsonl"
    data.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="HumanEval is the benchmark") as e:
        load_jsonl(data)
    assert f"{data}:2:" in str(e.value) and reason in str(e.value)


def test_rows_that_only_look_like_humaneval_are_kept(tmp_path: Path) -> None:
    """The check looks for HumanEval's marks, not for code: a user's own task ids, a `test` field alone
    and a prompt that mentions check(candidate) all train."""
    rows = [
        {"task_id": "mine/0", "prompt": "def f():\n"},
        {"text": "x", "test": "def check(candidate): pass"},
        {"prompt": "Write def check(candidate) for my function.", "name": "eval_helper"},
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(load_jsonl(data)) == 3


# Every row kind --data accepts (train_data.load_jsonl): prompts and chats the target answers, and
# text / token ids used as they are.
PROMPT = "Write a Python function that adds two numbers."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"


def _rows(tok) -> list[dict]:
    ids = list(tok.encode("Paris is the capital of France. speculative decoding drafts tokens"))
    return [{"prompt": PROMPT}, {"messages": CHAT}, {"text": TEXT}, {"token_ids": ids, "num_prompt_tokens": 3}]


def test_train_from_a_user_jsonl_then_serve_the_head(tiny_llama_dir: Path, tiny_llm: LLM, tmp_path: Path) -> None:
    """A few steps on the user's file write a head that speculative_config.model loads; greedy output
    with it equals plain decoding. The head records its target and training.json its data; the sequences it trained on
    (distill.jsonl) are the file's rows: chats answered by the target, text and ids as given."""
    tok = tiny_llm.get_tokenizer()
    rows = _rows(tok)
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "head"
    assert (
        train_main(
            [
                "--target",
                str(tiny_llama_dir),
                "--method",
                "eagle3",
                "--out",
                str(out),
                "--data",
                str(data),
                "--steps",
                "4",
                "--max-seq-len",
                "128",
                "--max-new-tokens",
                "24",
                "--batch-tokens",
                "512",
                "--quiet",
            ]
        )
        == 0
    )
    cfg = read_head_config(out)
    loaded = tiny_llm.engine.loaded
    assert cfg.method == "eagle3" and cfg.target["name"] == loaded.name and cfg.target["identity"] == loaded.identity
    seqs = [json.loads(line) for line in (out / "distill.jsonl").read_text().splitlines()]
    chats = [[{"role": "user", "content": PROMPT}], CHAT]
    prompts = [tiny_llm.apply_chat_template(m) for m in chats]
    answered = {
        tuple(s["token_ids"][: s["num_prompt_tokens"]]) for s in seqs if len(s["token_ids"]) > s["num_prompt_tokens"]
    }
    assert {tuple(p) for p in prompts} <= answered  # both chats, answered by the target
    assert {"token_ids": list(tok.encode(TEXT)), "num_prompt_tokens": 0} in seqs
    assert {"token_ids": rows[3]["token_ids"], "num_prompt_tokens": 3} in seqs
    assert len(seqs) == len(rows)
    # training.json says what the head learned from (the user's file, not stdlib self-distillation).
    made = json.loads((out / "training.json").read_text())
    assert made["data"] == str(data.resolve()) and made["steps"] == 4 and made["method"] == "eagle3"
    assert made["num_sequences"] == len(seqs) and made["num_tokens"] == sum(len(s["token_ids"]) for s in seqs)

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    spec = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={"method": "eagle3", "model": str(out), "num_speculative_tokens": 3, "adaptive": False},
    )
    inputs = [{"prompt_token_ids": p} for p in prompts + [rows[3]["token_ids"][:3]]]
    got = [o.outputs[0].token_ids for o in spec.generate(inputs, params)]
    plain = [o.outputs[0].token_ids for o in tiny_llm.generate(inputs, params)]
    assert got == plain
    assert spec.engine.stats.get("spec_decode_num_draft_tokens_total") > 0  # the head did draft


def test_progress_bars_on_stderr_unless_quiet(
    tiny_llama_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Without --quiet the self-distillation and training bars (tqdm) are drawn on stderr, the training
    one up to its last step; --quiet draws neither."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"text": TEXT}) + "\n")
    argv = [
        "--target",
        str(tiny_llama_dir),
        "--method",
        "eagle3",
        "--data",
        str(data),
        "--steps",
        "2",
        "--max-seq-len",
        "128",
        "--max-new-tokens",
        "8",
        "--batch-tokens",
        "256",
    ]
    capfd.readouterr()
    assert train_main(argv + ["--out", str(tmp_path / "loud")]) == 0
    out, err = capfd.readouterr()
    assert "self-distillation" in err and "train eagle3" in err and "2/2" in err and "100%|" in err, err
    assert "train eagle3" not in out  # the bar is not mixed into the result on stdout
    assert train_main(argv + ["--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    out, err = capfd.readouterr()
    assert "self-distillation" not in err and "train eagle3" not in err and "%|" not in err, err  # no bar at all
    assert "wrote" in out  # it did run
