"""Incremental detokenization with stop strings: decode a window of recent tokens with and without the
newest ones and emit the difference; a window ending in U+FFFD waits (no broken UTF-8 character)."""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context so the first output token decodes as it would mid-text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any | None,
        prompt_ids: list[int],
        stop: list[str],
        include_stop: bool,
        skip_special: bool,
        deferred: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        # Fast tokenizers decode incrementally in Rust (tokenizers.decoders.DecodeStream): O(1)
        # per token instead of two window decodes. Primed with the prompt tail as left context.
        self._stream = _decode_stream(tokenizer, skip_special, self.ids)
        self.stop, self.include_stop, self.skip_special = stop, include_stop, skip_special
        # Characters held back while streaming: they might be the start of a stop string.
        self.holdback = max((len(s) for s in stop), default=1) - 1
        # Deferred (no stop strings to watch for): tokens are fed when the text is read (`catch_up`), not
        # each step, so requests whose output nobody reads mid-generation cost no decoding per step.
        self.deferred = deferred and not stop
        self.num_fed = 0  # deferred: output tokens fed so far

    def _decode(self, ids: list[int]) -> str:
        assert self.tokenizer is not None  # a model without a tokenizer streams no text
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append tokens; returns the stop string that matched (text is then cut), else None."""
        if self.tokenizer is None:
            return None
        if self._stream is not None:
            stream, backend = self._stream
            old_len = len(self.text)
            for t in token_ids:
                piece = stream.step(backend, t)
                if piece:
                    self.text += piece
            return self._check_stop(old_len) if check_stop and len(self.text) > old_len else None
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return None  # incomplete character (or nothing printable yet): wait
        old_len = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop(old_len) if check_stop else None

    def catch_up(self, output_ids: list[int], num_text_tokens: int) -> None:
        """Deferred: feed output_ids[num_fed:num_text_tokens] one at a time, as each step would have (with no
        stop strings, the text after each token is the same whether it is fed then or now)."""
        for tok in output_ids[self.num_fed : num_text_tokens]:
            self.add_tokens([tok], check_stop=False)
        self.num_fed = max(self.num_fed, num_text_tokens)

    def _check_stop(self, old_len: int) -> str | None:
        found = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0]
        if not found:
            return None
        idx, s = min(found, key=lambda f: f[0])  # the earliest match; the first listed among equals
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def visible_text(self, finished: bool) -> str:
        return self.text if finished or self.holdback == 0 else self.text[: max(0, len(self.text) - self.holdback)]


def _decode_stream(tokenizer: Any | None, skip_special_tokens: bool, context: list[int]):
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if backend is None:
        return None
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    for t in context:
        stream.step(backend, t)
    return stream, backend
