"""bench/spec_bench.py on the CPU: one run compares no speculation, fixed k and the adaptive
controller for n-gram and a draft model, all at once and one at a time, with greedy outputs equal
to the baseline's; and the held-out stdlib files never reach draft-head training."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specserve.train import data as train_data
from tests.helpers.tiny_models import make_tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import spec_bench

MAX_TOKENS = 12


def test_spec_bench_compares_every_policy_in_one_run(tiny_llama_dir, tmp_path):
    # The draft is the target's twin (same seed): every drafted token must be accepted.
    draft_dir = make_tiny_model_dir(tmp_path / "draft", arch="llama", seed=1)
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(f'{{"prompt": "def f{i}(x):\\n    return x + {i}\\n"}}\n' for i in range(3)))
    out = tmp_path / "spec_bench.json"
    args = spec_bench.parse_args(
        [
            "--target",
            str(tiny_llama_dir),
            "--draft",
            str(draft_dir),
            "--ks",
            "1,2",
            "--num-prompts",
            "3",
            "--one-prompts",
            "2",
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
            "--max-model-len",
            "256",
            "--kv-cache-gib",
            "0.01",
            "--humaneval",
            str(problems),
            "--out",
            str(out),
        ]
    )
    rows = spec_bench.run(args)

    names = [
        "none",
        "ngram k=1",
        "ngram k=2",
        "ngram adaptive K=2",
        "draft_model k=1",
        "draft_model k=2",
        "draft_model adaptive K=2",
    ]
    assert [(r.config, r.mode) for r in rows] == [(n, m) for n in names for m in ("all", "one")]
    for r in rows:
        assert r.tokens == r.requests * MAX_TOKENS and r.tok_s > 0
        assert r.requests == (3 if r.mode == "all" else 2)
        if r.method == "none":
            assert r.x_none is None and r.drafts == 0
            continue
        assert r.same_as_none == 1.0  # greedy speculation is lossless
        assert r.x_none == pytest.approx(
            r.tok_s / next(b.tok_s for b in rows if b.method == "none" and b.mode == r.mode), abs=1e-3
        )
        assert (r.x_best_fixed is not None) == r.adaptive
        if r.method == "draft_model" and not r.adaptive:
            assert r.drafts > 0 and r.accepted == r.draft_tokens <= r.k * r.drafts
    saved = json.loads(out.read_text())
    assert [(r["config"], r["mode"]) for r in saved["rows"]] == [(r.config, r.mode) for r in rows]
    table = spec_bench.table(rows).splitlines()
    assert len(table) == 1 + len(rows) and "x none" in table[0]


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--methods", "medusa"], "--methods"),
        (["--modes", "some"], "--modes"),
        (["--ks", "0"], "--ks"),
        (["--methods", "eagle3"], "--methods"),
    ],
)
def test_spec_bench_refuses_bad_arguments(argv, field, capsys):
    with pytest.raises(SystemExit):
        spec_bench.parse_args(argv)
    assert field in capsys.readouterr().err


def test_held_out_stdlib_files_are_never_training_sources():
    root = train_data.stdlib_root()
    held = [root / n for n in train_data.HELD_OUT_STDLIB_MODULES if (root / n).is_file()]
    assert len(held) >= len(train_data.HELD_OUT_STDLIB_MODULES) - 2  # every CPython ships nearly all of them
    sources = set(train_data._stdlib_files())
    assert sources and not sources & set(held)
