"""Tensor parallelism on the CPU (gloo): greedy output equals tensor_parallel_size 1, with and
without speculation; bad sizes are refused before any process starts; a killed rank makes the
engine fail fast (no hang), the server answer 503 on /health, then exit by itself cleanly.

Each TP engine starts one interpreter per extra rank, so the tests share few engines and keep
outputs short (CI has 2 cores).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specserve import LLM, SamplingParams
from specserve.model.catalog import install_command, model_path
from tests.helpers.server_proc import free_port, wait_healthy
from tests.helpers.tiny_models import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of", "numbers 0 1 2 3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny_tp3_dir(tmp_path_factory) -> Path:
    """6 heads / 3 KV heads: shards over 3 ranks (and refuses 2)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-tp3"), seed=3, hidden_size=96, num_heads=6, num_kv_heads=3)


def _tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@contextlib.contextmanager
def _tp_llm(model: str, tp: int, **kw) -> Iterator[LLM]:
    llm = LLM(model=model, progress=False, tensor_parallel_size=tp, **kw)
    try:
        yield llm
    finally:
        llm.engine.runner.close()  # one process group per process: free it for the next engine
    assert all(p.poll() is not None for p in llm.engine.runner.procs.procs.values())


def test_tp2_matches_tp1_plain_and_with_draft_model(tiny_llama_dir):
    kw = dict(kv_cache_memory_bytes=4 << 20)
    ref = _tokens(LLM(model=str(tiny_llama_dir), progress=False, **kw), PROMPTS)
    with _tp_llm(str(tiny_llama_dir), 2, **kw) as llm:
        assert _tokens(llm, PROMPTS) == ref
        assert llm.engine.runner.spec.num_kv_heads == 1  # 2 KV heads over 2 ranks
    draft = {
        "method": "draft_model",
        "model": str(tiny_llama_dir),
        "num_speculative_tokens": 3,
        "draft_tensor_parallel_size": 1,
        "adaptive": False,
    }
    with _tp_llm(str(tiny_llama_dir), 2, speculative_config=draft, **kw) as llm:
        assert _tokens(llm, PROMPTS) == ref
        assert llm.engine.stats.get("spec_decode_num_accepted_tokens_total") > 0


def test_tp3_matches_tp1_plain_and_ngram(tiny_tp3_dir):
    kw = dict(kv_cache_memory_bytes=4 << 20)
    ref = _tokens(LLM(model=str(tiny_tp3_dir), progress=False, **kw), PROMPTS)
    with _tp_llm(str(tiny_tp3_dir), 3, **kw) as llm:
        assert _tokens(llm, PROMPTS) == ref
    with _tp_llm(str(tiny_tp3_dir), 3, speculative_config=NGRAM, **kw) as llm:
        assert _tokens(llm, PROMPTS) == ref
        assert llm.engine.stats.get("spec_decode_num_drafts_total") > 0


def test_smollm2_tp3_matches_tp1_plain_and_ngram():
    if model_path(SMOLLM2) is None:
        pytest.fail(f"{SMOLLM2} is not installed; run: {install_command(SMOLLM2)}")
    kw = dict(max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=8)  # 8 MiB: ~176 tokens at tp 1
    messages = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Count from 1 to 10."}],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ref = [o.outputs[0].token_ids for o in LLM(model=SMOLLM2, progress=False, **kw).chat(messages, params)]
    for spec in (None, NGRAM):
        with _tp_llm(SMOLLM2, 3, speculative_config=spec, **kw) as llm:
            assert [o.outputs[0].token_ids for o in llm.chat(messages, params)] == ref, spec


@pytest.mark.parametrize("tp, match", [(2, "3 KV heads"), (4, "6 attention heads"), (5, "6 attention heads")])
def test_sizes_that_do_not_divide_the_heads_are_refused(tiny_tp3_dir, tp, match):
    before = _children(os.getpid())
    with pytest.raises(ValueError, match=f"tensor_parallel_size {tp} must divide the model's {match}"):
        LLM(model=str(tiny_tp3_dir), progress=False, tensor_parallel_size=tp)
    assert _children(os.getpid()) == before  # refused before any rank started


def test_unsupported_combinations_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        LLM(
            model=str(tiny_llama_dir),
            progress=False,
            speculative_config={"method": "draft_model", "model": str(tiny_llama_dir), "draft_tensor_parallel_size": 2},
        )
    with pytest.raises(ValueError, match="kv_offload is not supported with tensor_parallel_size"):
        LLM(model=str(tiny_llama_dir), progress=False, tensor_parallel_size=2, kv_offload={"cpu_bytes": 1 << 20})
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(model=str(tiny_llama_dir), progress=False, tensor_parallel_size=0)


def test_killed_worker_fails_the_next_step_fast(tiny_llama_dir):
    from specserve.distributed.executor import WorkerDiedError

    with _tp_llm(str(tiny_llama_dir), 2, kv_cache_memory_bytes=4 << 20) as llm:
        assert len(_tokens(llm, PROMPTS[:1])) == 1
        (pid,) = llm.engine.runner.worker_pids.values()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1 .*exit code -9"):
            _tokens(llm, PROMPTS)
        with pytest.raises(WorkerDiedError):  # and every later step, at once
            _tokens(llm, PROMPTS)
        assert time.monotonic() - start < 10


def _children(pid: int) -> set[int]:
    """pids whose parent is `pid` (Linux /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry.name))
    return out


def test_server_rank_killed_mid_stream_gives_503_and_clean_exit(tiny_llama_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "specserve.server.cli",
        "serve",
        str(tiny_llama_dir),
        "--port",
        str(port),
        "--kv-cache-memory-bytes",
        "4M",
        "--tensor-parallel-size",
        "2",
        "--log-interval",
        "0",
        "--graceful-shutdown-timeout",
        "1",
    ]
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        wait_healthy(url, proc, timeout=120.0)
        (worker,) = _children(proc.pid)
        body = {"prompt": "story", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            threading.Timer(0.05, os.kill, (worker, signal.SIGKILL)).start()
            rest = [line for line in lines if line.startswith("data: ")]  # ends, never hangs
        assert any('"engine_unavailable"' in line for line in rest), rest[-3:]
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        rc = proc.wait(timeout=30)  # it exits by itself a few seconds after the rank died
    finally:
        if proc.poll() is None:
            proc.kill()
    err = stderr_path.read_text()
    assert rc == 1, err[-3000:]
    assert "engine loop died" in err, err[-3000:]  # the cause is logged (with its traceback) before
