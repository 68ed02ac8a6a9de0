"""Two CPU replicas of the embedded model on Ray Serve behind specserve's front door.

One Ray instance for the module (its own RAY_TMPDIR, so its processes are recognisable); the
last test shuts it down and checks that none of them is left.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import tempfile
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs the specserve[ray] extra")

from specserve.bench.metrics_parse import parse_metrics
from specserve.config import DEFAULT_MODEL
from tests.helpers.ray_procs import ray_processes
from tests.helpers.server_proc import free_port

pytestmark = pytest.mark.slow
ENGINE = {"model": DEFAULT_MODEL, "kv_cache_memory_bytes": 256 << 20, "max_model_len": 1024}
PROMPTS = [
    f"Question {i}: what is {i} plus {i * 3}? Answer:" if i % 2 else f"Write a short poem about the number {i}."
    for i in range(32)
]


@pytest.fixture(scope="module")
def cluster():
    from specserve.ray import start, stop
    from specserve.server.cli_args import ServerConfig

    tmpdir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length limit
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmpdir
    url = start(
        ENGINE,
        2,
        ServerConfig(port=free_port(), log_interval=0),
        ray_init={"num_cpus": 4, "object_store_memory": 128 << 20, "log_to_driver": False},
    )
    state = {"url": url, "tmpdir": tmpdir, "stop": stop, "stopped": False}
    yield state
    if not state["stopped"]:
        stop(joined=False)
    if old is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = old
    shutil.rmtree(tmpdir, ignore_errors=True)


def _complete(
    url: str, prompt: str, max_tokens: int = 8, stream: bool = False, streaming_on_1: threading.Event | None = None
) -> tuple[int, str, str, dict]:
    """(status, replica, text or error code, usage) of one completion; a stream is reassembled.
    `streaming_on_1` is set once a stream from replica 1 has delivered its first event."""
    body = {
        "model": DEFAULT_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
        "ignore_eos": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        replica = r.headers.get("x-specserve-replica", "")
        if not stream or r.status_code != 200:
            data = json.loads(r.read())
            if r.status_code != 200:
                return r.status_code, replica, data["error"]["code"], {}
            return 200, replica, data["choices"][0]["text"], data["usage"]
        text, usage = "", {}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 599, replica, event["error"]["code"], {}
            text += "".join(c["text"] for c in event["choices"])
            if streaming_on_1 is not None and replica == "1":
                streaming_on_1.set()
            usage = event.get("usage") or usage
        return 200, replica, text, usage


def _many(url: str, prompts: list[str], **kw) -> list[tuple[int, str, str, dict]]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(url, p, **kw), prompts))


def _metrics(url: str):
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text, time.time())


def test_greedy_equals_single_engine(cluster):
    from specserve import LLM, SamplingParams

    results = _many(cluster["url"], PROMPTS)
    llm = LLM(**ENGINE)
    expected = [
        o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ]
    del llm
    assert [r[0] for r in results] == [200] * len(PROMPTS)
    assert [r[2] for r in results] == expected
    assert {r[1] for r in results} == {"0", "1"}  # both replicas served
    status, _, text, usage = _complete(cluster["url"], PROMPTS[1], stream=True)
    assert (status, text, usage) == (200, expected[1], results[1][3])
    models = httpx.get(cluster["url"] + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == DEFAULT_MODEL
    assert httpx.get(cluster["url"] + "/health", timeout=30).status_code == 200


def test_shared_prefix_lands_on_one_replica(cluster):
    url = cluster["url"]
    system = (
        "You are a careful assistant for a library. Answer questions about opening hours, loans, "
        "late fees, reading rooms, printing, interlibrary requests and study spaces. "
    ) * 3
    prompts = [system + f"Visitor {i}: may I borrow {i + 2} books at once?" for i in range(6)]
    before = _metrics(url)
    first = _complete(url, prompts[0])  # fills the prefix cache of the replica it lands on
    rest = _many(url, prompts[1:])
    after = _metrics(url)
    replicas = {first[1]} | {r[1] for r in rest}
    assert len(replicas) == 1 and all(r[0] == 200 for r in [first, *rest])
    owner = replicas.pop()
    other = "1" if owner == "0" else "0"

    def hits(snap, replica):
        return snap.by_label("prefix_cache_hits_total", "replica").get(replica, 0.0)

    assert hits(after, owner) - hits(before, owner) >= 5 * 64  # each later prompt reused the prefix blocks
    assert hits(after, other) == hits(before, other)
    served = after.by_label("request_success_total", "replica")
    assert set(served) == {"0", "1"}  # the merged page labels every replica's series


def test_client_disconnect_aborts_on_the_replica(cluster):
    url = cluster["url"]
    body = {
        "model": DEFAULT_MODEL,
        "prompt": "Count slowly from one to one thousand:",
        "max_tokens": 900,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    before = _metrics(url).value("generation_tokens_total")
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # streaming has started; leave after the first event
    deadline, snap = time.monotonic() + 20, _metrics(url)
    while snap.value("num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        snap = _metrics(url)
    assert snap.value("num_requests_running") == 0
    generated = snap.value("generation_tokens_total") - before
    assert 0 < generated < 900  # stopped mid-way, not run to max_tokens
    time.sleep(1.0)
    assert _metrics(url).value("generation_tokens_total") == snap.value("generation_tokens_total")


def test_killing_a_replica_loses_no_request(cluster):
    from ray import serve

    url = cluster["url"]
    victim = serve.get_deployment_handle("specserve-replica-1", app_name="specserve")
    old_pid = victim.info.remote().result()["pid"]
    prompts = [f"Item {i}: list three facts about the number {i}." for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        streaming_on_1 = threading.Event()
        futures = [pool.submit(_complete, url, p, 32, i % 2 == 0, streaming_on_1) for i, p in enumerate(prompts)]
        assert streaming_on_1.wait(120)
        os.kill(old_pid, signal.SIGKILL)  # mid-stream for some requests, queued for others
        results = [f.result(timeout=300) for f in futures]
    completed = sum(r[0] == 200 for r in results)
    retryable = sum(r[0] in (503, 599) and r[2] == "engine_unavailable" for r in results)
    print(f"completed {completed}, retryable errors {retryable}")
    assert completed + retryable == 64
    assert retryable >= 1  # the stream that was under way on the killed replica ended with an error event
    assert completed >= 32  # requests not yet streaming on the dead replica were retried, not failed
    deadline = time.monotonic() + 180  # Ray replaces the replica; the front door routes to it again
    while time.monotonic() < deadline:
        new = [_complete(url, f"Again {i}, the number {i}.", 4) for i in range(4)]
        if {r[1] for r in new} == {"0", "1"}:
            break
        time.sleep(2.0)
    assert {r[1] for r in new} == {"0", "1"} and all(r[0] == 200 for r in new)
    assert victim.info.remote().result()["pid"] != old_pid


def test_shutdown_leaves_no_ray_process(cluster):
    assert ray_processes(cluster["tmpdir"])  # the check below can see them
    cluster["stop"](joined=False)
    cluster["stopped"] = True
    deadline = time.monotonic() + 30
    while ray_processes(cluster["tmpdir"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_processes(cluster["tmpdir"]) == []
