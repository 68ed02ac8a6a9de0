"""`StructuredSpec` (canonical, hashable `structured_outputs`), `build_grammar` (no tokenizer needed) and
`GrammarCache` (compiled grammars, LRU); xgrammar is imported lazily."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FIELD = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams options we honour (or that are no-ops for xgrammar).
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
_UNSUPPORTED = ("structural_tag", "whitespace_pattern")
# xgrammar error text starts with "[hh:mm:ss] /path/file.cc:123: "; users need only the rest.
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclass(frozen=True)
class StructuredSpec:
    """What to constrain the output to."""

    kind: str  # one of KINDS
    value: str
    any_whitespace: bool = True  # JSON kinds: allow any whitespace between tokens (vLLM default)


def load_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ValueError(f"{FIELD} needs the xgrammar package: pip install xgrammar ({e}).") from e
    return xgrammar


def parse_structured_outputs(
    spec: dict[str, Any] | None, field: str = FIELD, value_label: str | None = None
) -> StructuredSpec | None:
    """Check the dict's shape and return its canonical spec (None = unconstrained)."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"{field} must be a dict such as {{'json': schema}}, got {type(spec).__name__}.")
    unknown = sorted(set(spec) - set(KINDS) - set(_OPTIONS) - set(_UNSUPPORTED))
    if unknown:
        raise ValueError(
            f"{field} has unknown keys {unknown}; expected one of {list(KINDS)}, options {list(_OPTIONS)}."
        )
    for key in _UNSUPPORTED:
        if spec.get(key) is not None:
            raise ValueError(f"{field}.{key} is not supported.")
    kinds = [k for k in KINDS if spec.get(k) is not None and spec.get(k) is not False]
    if len(kinds) != 1:
        raise ValueError(f"{field} needs exactly one of {list(KINDS)}, got {kinds or 'none'}.")
    kind = kinds[0]
    any_ws = not spec.get("disable_any_whitespace", False)
    return StructuredSpec(kind, _canonical_value(kind, spec[kind], value_label or f"{field}.{kind}"), bool(any_ws))


def _canonical_value(kind: str, value: Any, name: str) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name} is not valid JSON: {e}.") from e
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a JSON schema object, got {type(value).__name__}.")
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{name} must be True, got {value!r}.")
        return ""
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}.")
        return value
    bad = isinstance(value, str) or not isinstance(value, Sequence) or not value
    if bad or not all(isinstance(c, str) for c in value):
        raise ValueError(f"{name} must be a non-empty list of strings, got {value!r}.")
    return json.dumps(list(value), ensure_ascii=False)


def build_grammar(spec: StructuredSpec, field: str = FIELD, value_label: str | None = None) -> Any:
    """The xgrammar.Grammar for a spec (no tokenizer needed)."""
    xgr = load_xgrammar()
    try:
        if spec.kind in ("json", "json_object"):
            # OpenAI's json_object is "some JSON object": an open schema, not any JSON value.
            schema, strict = (spec.value, True) if spec.kind == "json" else ('{"type":"object"}', False)
            g = xgr.Grammar.from_json_schema(schema, any_whitespace=spec.any_whitespace, strict_mode=strict)
            return _fix_json_strings(xgr, g)
        if spec.kind in ("regex", "grammar"):
            return (xgr.Grammar.from_regex if spec.kind == "regex" else xgr.Grammar.from_ebnf)(spec.value)
        # choice: an EBNF alternation of string literals; JSON string escapes are EBNF's too.
        choices = json.loads(spec.value)
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    except (RuntimeError, ValueError, TypeError) as e:
        names = {"json": "JSON schema", "json_object": "JSON object grammar", "choice": "choice list"}
        what = {**names, "grammar": "EBNF grammar"}.get(spec.kind, spec.kind)
        raise ValueError(f"{value_label or f'{field}.{spec.kind}'}: invalid {what}: {_clean_error(e)}") from e


# JSON string character classes as xgrammar (<= 0.2.9) writes them -> what JSON allows unescaped: they admit raw
# control characters and UTF-16 surrogates (invalid UTF-8), so the output would not parse.
_JSON_CHAR_CLASSES = (
    (r"[^\"\\\r\n]", r"[^\"\\\0-\x1f\ud800-\udfff]"),
    (r"[^\0-\x1f\"\\\r\n]", r"[^\0-\x1f\"\\\ud800-\udfff]"),
)


def _fix_json_strings(xgr: Any, grammar: Any) -> Any:
    fixed = text = str(grammar)
    for loose, strict in _JSON_CHAR_CLASSES:
        fixed = fixed.replace(loose, strict)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def _clean_error(e: Exception) -> str:
    lines = [_XGR_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line)[:500]


class GrammarCache:
    """Compiles specs against one tokenizer and keeps the `max_entries` most recently used."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], max_entries: int = 128) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = [t for t in stop_token_ids if t < vocab_size]
        self.max_entries = max_entries
        self._compiler: Any = None
        self._entries: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            if self._tokenizer is None:
                raise ValueError(f"{FIELD} needs a tokenizer; this model has none.")
            xgr = load_xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids or None
            )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def get(self, spec: StructuredSpec) -> Any:
        """The xgrammar.CompiledGrammar for `spec`; ValueError (naming structured_outputs) if invalid."""
        with self._lock:
            compiled = self._entries.get(spec)
            if compiled is not None:
                self._entries.move_to_end(spec)
                self.hits += 1
                return compiled
            compiler = self._get_compiler()
        grammar = build_grammar(spec)  # outside the lock: compiles of different specs overlap
        try:
            compiled = compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"{FIELD}.{spec.kind}: cannot compile: {_clean_error(e)}") from e
        with self._lock:
            self.misses += 1
            self._entries[spec] = compiled
            self._entries.move_to_end(spec)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, spec: object) -> bool:
        return spec in self._entries
