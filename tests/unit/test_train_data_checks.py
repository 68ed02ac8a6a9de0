"""`train-draft --data`: a bad line or file is a clear error naming the file and line (exit 2), never a
traceback deep in training; token ids must index the target's vocabulary (found by an independent
check: a missing file, messages as a string, a message without content, an id past the vocabulary)."""

from __future__ import annotations

import pytest

from specserve.train.loop import train_main


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"messages": "hello"}', "messages must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', "messages must be a non-empty list"),
        ('{"token_ids": [1, -5, 3]}', "token_ids must be a non-empty list of non-negative integers"),
        ('{"token_ids": [1, "x"]}', "token_ids must be a non-empty list of non-negative integers"),
        ('{"token_ids": [1, 2, 3], "num_prompt_tokens": 4}', "num_prompt_tokens must be"),
        ('{"prompt": 5}', "prompt must be a non-empty string"),
        ("[1, 2]", "a line must be a JSON object"),
        ('{"token_ids": [1, 2, 99999999, 4]}', "outside the target's vocabulary"),
    ],
)
def test_bad_data_lines_are_named(tiny_llama_dir, tmp_path, capsys, line, match) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine line"}\n' + line + "\n")
    argv = [
        "--target",
        str(tiny_llama_dir),
        "--method",
        "eagle3",
        "--out",
        str(tmp_path / "h"),
        "--steps",
        "1",
        "--data",
        str(data),
        "--max-seq-len",
        "256",
        "--quiet",
    ]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    if "vocabulary" not in match:
        assert "d.jsonl:2" in err  # the file and line of the bad example


def test_missing_data_file(tiny_llama_dir, tmp_path, capsys) -> None:
    argv = [
        "--target",
        str(tiny_llama_dir),
        "--method",
        "eagle3",
        "--out",
        str(tmp_path / "h"),
        "--steps",
        "1",
        "--data",
        str(tmp_path / "nope.jsonl"),
        "--quiet",
    ]
    assert train_main(argv) == 2
    assert "cannot read" in capsys.readouterr().err
