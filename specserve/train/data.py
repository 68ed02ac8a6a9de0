"""Training data for draft heads: prompts made from the Python standard library, answered by the target."""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
import textwrap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

_SKIP_DIRS = set("test tests idle_test site-packages dist-packages __pycache__ lib2to3 turtledemo ensurepip".split())
_HUMANEVAL = re.compile(r"human[-_]?eval", re.IGNORECASE)
# Stdlib files training never uses, so other measurements (bench/kv_quality.py) have unseen text.
HELD_OUT_STDLIB_MODULES: tuple[str, ...] = tuple(
    "argparse.py difflib.py textwrap.py fractions.py statistics.py heapq.py bisect.py calendar.py shlex.py "
    "configparser.py json/decoder.py json/encoder.py".split()
)

_TEMPLATES = (
    "Complete the following Python function.\n\n```python\n{stub}\n```",
    "Explain what this Python code does, step by step.\n\n```python\n{source}\n```",
    "Write a Python function `{name}` that does the following:\n\n{doc}",
    "Write unit tests with pytest for this function.\n\n```python\n{source}\n```",
    "Refactor this code to be clearer and add type hints.\n\n```python\n{source}\n```",
    "{stub}\n    # Complete this function.",
    "Summarize this documentation and give a short usage example:\n\n{doc}",
    "Find possible bugs or edge cases in this code and suggest fixes.\n\n```python\n{source}\n```",
)


@dataclass
class Example:
    """One training sequence to build: a chat to answer, or finished text / token ids."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0  # with token_ids: the leading tokens the head is not trained to predict


@dataclass
class TrainSeq:
    """A training sequence; the loss covers the tokens after the prompt."""

    token_ids: list[int]
    num_prompt_tokens: int = 0


def refuse_humaneval(path: str | Path) -> None:
    """ValueError when the file's path names HumanEval (a renamed copy is caught row by row)."""
    if _HUMANEVAL.search(str(path)):
        raise ValueError(
            f"{path}: the path names HumanEval; HumanEval is the benchmark, never train draft heads on it."
        )


# Fields a HumanEval row (or a derivative's) names itself in.
_HUMANEVAL_ID_FIELDS = ("task_id", "name", "id", "source", "dataset")
# The data set's own schema: a row copied from it without its task_id still has these fields.
_HUMANEVAL_FIELDS = frozenset({"canonical_solution", "entry_point", "test"})


def refuse_humaneval_row(row: dict[str, Any], where: str) -> None:
    """ValueError when a --data row is a HumanEval task, whatever the file is called."""
    for key in _HUMANEVAL_ID_FIELDS:
        value = row.get(key)
        if isinstance(value, str) and _HUMANEVAL.search(value):
            reason = f"its {key} is {value!r}"
            break
    else:
        if not _HUMANEVAL_FIELDS <= row.keys():
            return
        reason = "it has HumanEval's fields (canonical_solution, entry_point, test)"
    raise ValueError(
        f"{where}: this row is a HumanEval task ({reason}); HumanEval is the benchmark, never train draft heads on it."
    )


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    """Training sources: the stdlib's .py files minus tests, vendored code and the held-out set."""
    root = stdlib_root()
    rel = {f: f.relative_to(root) for f in root.rglob("*.py") if not _HUMANEVAL.search(str(f))}
    return sorted(
        f for f, r in rel.items() if not _SKIP_DIRS & set(r.parts) and r.as_posix() not in HELD_OUT_STDLIB_MODULES
    )


def _defs(path: Path) -> list[dict[str, str]]:
    """Functions and classes with a docstring: source, a stub (signature + docstring), name, doc."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    out = []
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        # Whole lines by line numbers: ast.get_source_segment rescans the file for every node.
        source = "\n".join(lines[node.lineno - 1 : node.end_lineno]) if node.end_lineno else None
        if not doc or not source or not 40 <= len(doc) <= 1200 or not 120 <= len(source) <= 2400:
            continue
        source = textwrap.dedent(source)
        header = source.split("\n", 1)[0]
        stub = f'{header}\n    """{textwrap.indent(doc, "    ").strip()}\n    """'
        out.append({"source": source, "stub": stub, "name": node.name, "doc": doc})
    return out


def stdlib_examples(num: int, seed: int = 0) -> list[Example]:
    """`num` chat prompts from stdlib definitions, spread over modules, deterministic for a seed."""
    rng = random.Random(seed)
    files = _stdlib_files()
    rng.shuffle(files)
    pool: list[dict[str, str]] = []
    parsed: list[list[dict[str, str]]] = []
    for f in files:
        defs = _defs(f)
        rng.shuffle(defs)
        parsed.append(defs)
        pool.extend(defs[:8])  # a few per module, so one big module does not dominate
        if len(pool) >= 2 * num:
            break
    start = 8
    while len(pool) < 2 * num and any(len(d) > start for d in parsed):  # large runs: 8 more per module
        for defs in parsed:
            pool.extend(defs[start : start + 8])
        start += 8
    rng.shuffle(pool)
    examples = []
    for i in range(num):
        d = pool[i % len(pool)]
        prompt = _TEMPLATES[rng.randrange(len(_TEMPLATES))].format(**d)
        examples.append(Example(messages=[{"role": "user", "content": prompt}]))
    return examples


def load_jsonl(path: str | Path) -> list[Example]:
    """Examples of a JSONL file; a bad line raises ValueError naming the file and line."""
    refuse_humaneval(path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}.") from None
    examples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}.") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: a line must be a JSON object.")
        refuse_humaneval_row(row, f"{path}:{n}")
        examples.append(_example(row, f"{path}:{n}"))
    if not examples:
        raise ValueError(f"{path} holds no examples.")
    return examples


def _example(row: dict[str, Any], where: str) -> Example:
    if "token_ids" in row:
        ids, num_prompt = row["token_ids"], row.get("num_prompt_tokens", 0)
        if not isinstance(ids, list) or not ids or not all(_is_count(t) for t in ids):
            raise ValueError(f"{where}: token_ids must be a non-empty list of non-negative integers.")
        if not _is_count(num_prompt) or num_prompt > len(ids):
            raise ValueError(f"{where}: num_prompt_tokens must be an integer in [0, len(token_ids)].")
        return Example(token_ids=list(ids), num_prompt_tokens=num_prompt)
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
            raise ValueError(f"{where}: messages must be a non-empty list of {{'role': str, 'content': str}}.")
        return Example(messages=list(messages))
    for key in ("prompt", "text"):
        if key in row:
            if not isinstance(row[key], str) or not row[key]:
                raise ValueError(f"{where}: {key} must be a non-empty string.")
            if key == "text":
                return Example(text=row[key])
            return Example(messages=[{"role": "user", "content": row[key]}])
    raise ValueError(f"{where}: needs 'prompt', 'messages', 'text' or 'token_ids'.")


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_vocab(examples: list[Example], vocab_size: int, path: str | Path) -> None:
    """ValueError unless every token id indexes the target's vocabulary."""
    for i, e in enumerate(examples):
        if e.token_ids is not None and max(e.token_ids) >= vocab_size:
            raise ValueError(
                f"{path}: example {i + 1} has token id {max(e.token_ids)}, outside the target's "
                f"vocabulary [0, {vocab_size})."
            )


def _prompt_ids(llm, messages: list[dict[str, str]]) -> list[int]:
    tok = llm.get_tokenizer()
    if getattr(tok, "chat_template", None):
        return llm.apply_chat_template(messages)
    return list(tok.encode("\n\n".join(m["content"] for m in messages)))


def _fit_prompt(llm, messages: list[dict[str, str]], limit: int) -> list[int] | None:
    """Prompt ids of at most `limit` tokens, the last message shortened (never the template)."""
    for _ in range(4):
        ids = _prompt_ids(llm, messages)
        if len(ids) <= limit:
            return ids
        content = messages[-1]["content"]
        keep = int(len(content) * limit / len(ids) * 0.9)
        if keep < 16:
            return None
        messages = messages[:-1] + [{**messages[-1], "content": content[:keep]}]
    return None


def build_sequences(
    llm,
    examples: list[Example],
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float,
    deadline: float,
    seed: int = 0,
    progress: bool = True,
) -> list[TrainSeq]:
    """Token sequences (prompt + the target's answer, at most max_seq_len) for every example."""
    from specserve.sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    seqs: list[TrainSeq] = []
    pending: dict[str, list[int]] = {}
    engine = llm.engine
    for i, ex in enumerate(examples):
        if ex.token_ids is not None:
            seqs.append(TrainSeq(ex.token_ids[:max_seq_len], ex.num_prompt_tokens))
        elif ex.text is not None:
            seqs.append(TrainSeq(list(tok.encode(ex.text))[:max_seq_len]))
        else:
            ids = _fit_prompt(llm, ex.messages, max_seq_len // 2)
            if ids is None:
                continue
            budget = min(max_new_tokens, max_seq_len - len(ids))
            params = SamplingParams(temperature=temperature, max_tokens=budget, seed=seed + i)
            engine.add_request(f"distill-{i}", {"prompt_token_ids": ids}, params)
            pending[f"distill-{i}"] = ids
    bar = tqdm(
        total=len(pending), desc="self-distillation", unit="prompt", leave=False, disable=not progress or not pending
    )
    while pending and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished and out.request_id in pending:
                ids = pending.pop(out.request_id)
                seqs.append(TrainSeq(ids + list(out.outputs[0].token_ids), len(ids)))
                bar.update(1)
    bar.close()
    if pending:  # cut at the deadline: keep what the running answers have so far
        engine.abort_request(list(pending))
        for out in engine.step():
            ids = pending.pop(out.request_id, None)
            if ids is not None and out.outputs[0].token_ids:
                seqs.append(TrainSeq(ids + list(out.outputs[0].token_ids), len(ids)))
    return [s for s in seqs if len(s.token_ids) - s.num_prompt_tokens >= 2 and len(s.token_ids) >= 4]


def save_sequences(path: str | Path, seqs: list[TrainSeq]) -> None:
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(
            json.dumps({"token_ids": s.token_ids, "num_prompt_tokens": s.num_prompt_tokens}) + "\n" for s in seqs
        )
    tmp.replace(path)


def make_batches(lengths: list[int], tokens_per_batch: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar lengths (less padding), each at most tokens_per_batch padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


class DraftVocab(NamedTuple):
    token_ids: list[int]  # ascending target ids (a head's d2t)
    answer_coverage: float  # share of the answer tokens (those the loss predicts) that are in token_ids


def draft_vocab(seqs: list[TrainSeq], vocab_size: int, size: int, special_ids: Iterable[int] = ()) -> DraftVocab:
    """The `size` tokens a reduced head may propose: the special tokens the sequences hold, then the most frequent
    answer tokens (those the loss trains on: from position max(2, num_prompt_tokens) on)."""
    answer = np.zeros(vocab_size, dtype=np.int64)
    whole = np.zeros(vocab_size, dtype=np.int64)
    for s in seqs:
        ids = np.asarray(s.token_ids, dtype=np.int64)
        in_range = (ids >= 0) & (ids < vocab_size)
        whole += np.bincount(ids[in_range], minlength=vocab_size)
        start = max(2, s.num_prompt_tokens)
        answer += np.bincount(ids[start:][in_range[start:]], minlength=vocab_size)
    size = min(size, vocab_size)
    specials = sorted({int(t) for t in special_ids if 0 <= int(t) < vocab_size and whole[int(t)] > 0})[:size]
    taken = np.zeros(vocab_size, dtype=bool)
    taken[specials] = True
    order = np.lexsort((np.arange(vocab_size), -whole, -answer))  # answer count, then whole count, then id
    rest = order[~taken[order]][: size - len(specials)]
    taken[rest] = True
    total = int(answer.sum())
    coverage = float(answer[taken].sum() / total) if total else 1.0
    return DraftVocab(np.flatnonzero(taken).tolist(), coverage)
