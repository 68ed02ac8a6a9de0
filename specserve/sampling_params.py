"""SamplingParams: vLLM's names and meanings; a bad value raises ValueError naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_LEAST = {"n": 1, "top_k": 0, "min_tokens": 0, "max_tokens": 1, "logprobs": 0, "prompt_logprobs": 0, "seed": -(1 << 63)}
_OPTIONAL = ("max_tokens", "logprobs", "prompt_logprobs", "seed")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}.")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        # Numbers first: NaN passes every comparison below, and true / false are no counts.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name, least in _LEAST.items():  # integer counts; those from max_tokens on may be None
            value = getattr(self, name)
            if not (name in _OPTIONAL and value is None) and (not _is_int(value) or value < least):
                raise bad(name, f"must be an integer >= {least}")
        if self.seed is not None and self.seed >= 1 << 64:
            raise bad("seed", "must fit in 64 bits")
        for name, ok, why in (
            ("temperature", self.temperature >= 0.0, "must be non-negative"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be greater than zero"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens, "must be <= max_tokens"),
            ("stop", all(isinstance(s, str) and s for s in self.stop_strings), "must be non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_ids), "must be token ids >= 0"),
            # the grammar itself is compiled (a bad one rejected) by the engine on admission
            ("structured_outputs", isinstance(self.structured_outputs, (dict, type(None))), "must be a dict"),
        ):
            if not ok:
                raise bad(name, why)

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as __post_init__ left it: always a list."""
        return cast(list[str], self.stop)

    @property
    def stop_ids(self) -> list[int]:
        """`stop_token_ids` as __post_init__ left it: always a list."""
        return cast(list[int], self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes: Any) -> SamplingParams:
        return SamplingParams(**({f: getattr(self, f) for f in self.__dataclass_fields__} | changes))
