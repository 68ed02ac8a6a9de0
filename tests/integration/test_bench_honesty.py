"""`specserve bench` saves its results without matplotlib, sends fresh prompts per concurrency point
(and says when a finite dataset must repeat them), estimates its duration, and shows defaults in --help;
against the stub server of test_bench_serving."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from specserve.bench import bench_main
from tests.helpers.server_proc import free_port
from tests.integration.test_bench_serving import STATE, bench_args, load, make_app


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    config = uvicorn.Config(make_app(), host="127.0.0.1", port=free_port(), log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{config.port}"
    srv.should_exit = True
    thread.join(timeout=10)


def test_results_are_saved_without_matplotlib(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    args = bench_args(
        server,
        tmp_path,
        "--num-prompts",
        "3",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--result-filename",
        "nomp.json",
    )
    assert bench_main(args) == 0
    out = capsys.readouterr().out
    assert load(tmp_path / "nomp.json")["runs"][0]["aggregates"]["completed"] == 3
    assert "Plots skipped" in out and "matplotlib" in out
    assert not list(tmp_path.glob("*.png"))


def test_each_sweep_point_sends_fresh_prompts(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    STATE["prompts"].clear()
    args = bench_args(
        server,
        tmp_path,
        "--num-prompts",
        "5",
        "--random-input-len",
        "12",
        "--random-output-len",
        "4",
        "--max-concurrency",
        "1,2,2",
        "--result-filename",
        "sweep.json",
    )
    assert bench_main(args) == 0
    sent = list(STATE["prompts"])
    assert len(sent) == 1 + 3 * 5
    probe, points = sent[0], [set(sent[1 + 5 * i : 6 + 5 * i]) for i in range(3)]
    assert all(len(p) == 5 and probe not in p for p in points)
    assert not points[0] & points[1] and not points[1] & points[2] and not points[0] & points[2]
    assert [r["repeated_prompts"] for r in load(tmp_path / "sweep.json")["runs"]] == [0, 0, 0]
    out = capsys.readouterr().out
    assert "Estimate: the probe request took" in out and "Note:" not in out


def test_a_repeating_dataset_says_the_cache_may_be_warm(
    server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "two.jsonl"
    data.write_text('{"prompt": "one two three"}\n{"prompt": "four five six"}\n')
    args = bench_args(
        server,
        tmp_path,
        "--dataset-name",
        "jsonl",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "2",
        "--output-len",
        "3",
        "--max-concurrency",
        "1,2",
        "--result-filename",
        "rep.json",
    )
    assert bench_main(args) == 0
    runs = load(tmp_path / "rep.json")["runs"]
    assert runs[0]["repeated_prompts"] == 1 and runs[1]["repeated_prompts"] == 2  # the probe sent one of the two
    assert "prefix cache may be warm" in capsys.readouterr().out


def test_estimate_brackets_the_run_and_help_shows_defaults() -> None:
    from specserve.bench.serving import estimate

    line = estimate(2.0, 1000, [None], float("inf"))
    assert "2 s to 33 min" in line and "--num-prompts" in line  # perfect batching .. one after another
    assert "20 s to 20 s" in estimate(0.01, 100, [4], 5.0)  # the arrival rate bounds both ends
    text = subprocess.run(
        [sys.executable, "-m", "specserve.server.cli", "bench", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag_default in ("(default: 1000)", "(default: 1024)", "(default: 128)", "(default: random)"):
        assert flag_default in " ".join(text.split()), flag_default
