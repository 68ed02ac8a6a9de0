"""Shared pieces of the OpenAI handlers: errors, validation, sampling params, logprobs, SSE streams.
Requests are validated before they reach the engine, so a bad one changes no engine state."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestStream
from specserve.outputs import CompletionOutput, Logprob, RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server.protocol import ErrorInfo, SamplingFields

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
MAX_N = 128  # n * prompts per HTTP request: keeps one request from flooding the scheduler
MAX_LOGPROBS = 20
MIN_LOGPROB = -9999.0  # JSON has no -inf
MAX_JSON_DEPTH = 64  # request bodies nest a few levels; json_schema / tool-like fields a few more
_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")  # only a JSON escape can put one into a str


@dataclass(eq=False)
class APIError(Exception):
    """An error answered with the OpenAI body; `message` is shown to the client verbatim."""

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = "invalid_value"
    headers: dict[str, str] | None = None  # extra response headers (Retry-After)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)}


INTERNAL_ERROR = APIError("internal server error", 500, "server_error", code="internal_error")


def body_too_large(limit: int) -> APIError:
    return APIError(f"request body exceeds the limit of {limit} bytes", 413, code="request_too_large")


def unavailable(message: str, headers: dict[str, str] | None = None) -> APIError:
    return APIError(message, 503, "service_unavailable_error", code="engine_unavailable", headers=headers)


def engine_error(e: Exception) -> APIError:
    """Map an exception from AsyncEngine.add_requests to the HTTP error the client sees."""
    if isinstance(e, EngineOverloadedError):
        return APIError(str(e), 503, "service_unavailable_error", code="overloaded", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return unavailable(str(e))
    if isinstance(e, ValueError):
        return APIError(str(e), 400, param=field_in_message(str(e)))
    raise e


_FIELD_RE = re.compile(r"^([a-z_][a-z0-9_]*)")
_OTHER_FIELDS = "prompt messages model max_completion_tokens top_logprobs prompt_token_ids"
_KNOWN_FIELDS = {*SamplingParams.__dataclass_fields__, *_OTHER_FIELDS.split()}


def field_in_message(message: str) -> str | None:
    """SamplingParams and the engine start their messages with the field's name."""
    m = _FIELD_RE.match(message)
    return m.group(1) if m and m.group(1) in _KNOWN_FIELDS else None


async def read_json(request: Request, limit: int) -> Any:
    """The body parsed (400), read up to `limit` bytes (413): valid Unicode, at most MAX_JSON_DEPTH deep."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    _check_json(body)
    return body


def _check_json(value: Any) -> None:
    """Depth and lone surrogates ("\\ud800" decodes to a str no tokenizer can encode)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str) and _SURROGATE_RE.search(v):
            raise APIError("request body holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode")
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
            items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer: Any) -> int:
    """The longest token string: a token covers at most this many characters of text."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=1)


def check_prompt_chars(engine: AsyncEngine, num_chars: int, param: str) -> None:
    """Reject a text too long for the context whatever its tokenization, before tokenizing it."""
    n = engine.max_model_len
    if num_chars > n * max_token_chars(require_tokenizer(engine, param)):
        why = f"your {param} has {num_chars} characters, more than {n} tokens can spell"
        raise too_long(n, f"{why}. Please reduce the length of the input.", param)


def too_long(max_model_len: int, why: str, param: str) -> APIError:
    msg = f"This model's maximum context length is {max_model_len} tokens. However, {why}"
    return APIError(msg, param=param, code="context_length_exceeded")


def parse_model(cls: type[M], body: Any) -> M:
    """Validate a JSON body into `cls`; pydantic errors become 400."""
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object", code="invalid_json")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


# Location parts naming a union member or validator, not a field: "str", "list[TextPart]", "TextPart".
_TYPE_TAG_RE = re.compile(r"^(str|int|float|bool|none|bytes)$|[\[\]-]|^[A-Z]")


def validation_error(errors: list[Any]) -> APIError:
    """400 for pydantic errors: `param` is the first error's top-level field, the message names its path."""
    if not errors:
        return APIError("request body is invalid")
    err = errors[0]
    parts = list(err.get("loc", ()))
    parts = parts[1:] if parts and parts[0] == "body" else parts  # FastAPI's RequestValidationError locations
    parts = [str(p) for p in parts if isinstance(p, int) or not _TYPE_TAG_RE.search(str(p))]
    loc = ".".join(parts)
    more = f" ({len(errors)} errors)" if len(errors) > 1 else ""
    message = f"{loc}: {err.get('msg', 'invalid value')}{more}" if loc else f"request body: {err.get('msg')}{more}"
    code = "unsupported" if err.get("type") == "unsupported" else "invalid_value"  # protocol's custom errors
    return APIError(message, param=parts[0] if parts else None, code=code)


def check_model(engine: AsyncEngine, model: str | None) -> None:
    if model is not None and model != engine.model_name:
        raise APIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")


_COPIED_FIELDS = (
    "n presence_penalty frequency_penalty seed stop stop_token_ids ignore_eos min_tokens include_stop_str_in_output "
    "skip_special_tokens spaces_between_special_tokens"
).split()
_NULL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def build_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, logprobs_param: str = "logprobs"
) -> SamplingParams:
    """SamplingParams from the request; unsupported features answer 400."""
    if req.logit_bias:
        raise APIError("logit_bias is not supported", param="logit_bias", code="unsupported")
    if not 1 <= req.n <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(f"{logprobs_param} must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param=logprobs_param)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be set when stream is true", param="stream_options")
    try:
        from specserve.sample.structured import structured_from_openai

        structured = structured_from_openai(req.response_format, req.structured_extras())
        kw = {n: getattr(req, n) for n in _COPIED_FIELDS}
        kw |= {n: default if getattr(req, n) is None else getattr(req, n) for n, default in _NULL_DEFAULTS.items()}
        return SamplingParams(structured_outputs=structured, max_tokens=max_tokens, logprobs=logprobs, **kw)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param=field_in_message(str(e))) from None


def fit_context(
    params: SamplingParams, prompt_lens: list[int], max_model_len: int, prompt_param: str
) -> SamplingParams:
    """Check prompt + max_tokens against the context; max_tokens None: what the context leaves."""
    longest = max(prompt_lens)
    if min(prompt_lens) == 0:
        raise APIError(f"{prompt_param} must not be empty", param=prompt_param)
    if longest >= max_model_len:
        why = f"your request has {longest} input tokens. Please reduce the length of the input."
        raise too_long(max_model_len, why, prompt_param)
    n = params.max_tokens
    if n is None:
        return params.clone(max_tokens=max_model_len - longest)
    if longest + n > max_model_len:
        why = f"you requested {longest + n} tokens ({longest} in the {prompt_param}, {n} in the completion). "
        raise too_long(
            max_model_len, f"{why}Please reduce the length of the {prompt_param} or completion.", "max_tokens"
        )
    return params


def truncation_size(k: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: how many (last) prompt tokens to keep, or None."""
    if k is None or k == -1:
        return None if k is None else max_model_len
    if k < 1:
        raise APIError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k}", param="truncate_prompt_tokens")
    if k > max_model_len:
        msg = f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len}); "
        raise APIError(msg + "select a smaller truncation size", param="truncate_prompt_tokens")
    return k


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise APIError(f"{param} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param=param)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def require_tokenizer(engine: AsyncEngine, param: str) -> Any:
    """The tokenizer, or a 400 for models served without one (token ids still work)."""
    if engine.tokenizer is None:
        raise APIError("this model has no tokenizer: send token ids", param=param, code="unsupported")
    return engine.tokenizer


def floor(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes as characters (GPT-2's table), inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(extra)}}


def token_bytes(engine: AsyncEngine, token_id: int, text: str) -> list[int]:
    """The token's UTF-8 bytes; a partial character (U+FFFD) takes its bytes from the vocabulary."""
    if "\ufffd" not in text or engine.tokenizer is None:
        return list(text.encode("utf-8"))
    piece = engine.tokenizer.convert_ids_to_tokens(token_id) or ""
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return [int(piece[3:5], 16)]
    table = _byte_of_char()
    return [table[ch] for ch in piece] if piece and all(ch in table for ch in piece) else list(text.encode("utf-8"))


def logprob_token(engine: AsyncEngine, token_id: int, lp: Logprob | None, as_ids: bool) -> tuple[str, str]:
    """(the token as shown in logprobs, its text); `as_ids`: shown as "token_id:{id}"."""
    if lp is not None and lp.decoded_token is not None:
        text = lp.decoded_token
    elif engine.tokenizer is None:
        text = f"token_id:{token_id}"  # vLLM's spelling when there is no tokenizer
    else:
        text = engine.tokenizer.decode([token_id])
    return (f"token_id:{token_id}" if as_ids else text), text


ScoredToken = tuple[int, Any, Any, str, str]  # (id, top dict or None, its Logprob or None, shown, text)


def scored_tokens(
    engine: AsyncEngine, ids: list[int], tops: list[Any] | None, as_ids: bool, missing: dict | None
) -> Iterator[ScoredToken]:
    """A ScoredToken per id; `missing`: the top dict of ids past `tops`."""
    for i, tid in enumerate(ids):
        top = tops[i] if tops is not None and i < len(tops) else missing
        sampled = top.get(tid) if top else None
        yield (tid, top, sampled, *logprob_token(engine, tid, sampled, as_ids))


def generated_tokens(engine: AsyncEngine, c: CompletionOutput, start: int, as_ids: bool) -> Iterator[ScoredToken]:
    """scored_tokens of c's tokens from `start` on."""
    tops = c.logprobs[start:] if c.logprobs is not None else None
    return scored_tokens(engine, c.token_ids[start:], tops, as_ids, {})


# (choice index, output, completion, new text, first new token, first update of the choice)
Update = tuple[int, RequestOutput, CompletionOutput, str, int, bool]


async def stream_chunks(
    req: SamplingFields,
    stream: RequestStream,
    index_of: Callable[[RequestOutput, CompletionOutput], int],
    make_chunk: Callable[[list[Any], Any], str],
    make_choice: Callable[[Update], Any],
    usage: Callable[[int], Any],
    keep_first: bool = False,
) -> AsyncIterator[str]:
    """SSE chunks of cumulative engine outputs, one choice per Update with something new (or a first one
    with `keep_first`); sent text is never rewritten. Ends with the usage chunk if asked, then [DONE]."""
    opts = req.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts is not None and opts.continuous_usage_stats
    sent_text: dict[int, str] = {}
    generated: dict[int, int] = {}
    done: set[int] = set()
    async for output in stream:
        for c in output.outputs:
            index = index_of(output, c)
            if index in done:
                continue
            sent = sent_text.get(index, "")
            delta = c.text[len(sent) :] if c.text.startswith(sent) else ""
            sent_text[index] = sent + delta
            first, start = index not in generated, generated.get(index, 0)
            generated[index] = len(c.token_ids)
            if not (keep_first and first) and not delta and c.finish_reason is None and len(c.token_ids) == start:
                continue
            if c.finish_reason is not None:
                done.add(index)
            choice = make_choice((index, output, c, delta, start, first))
            yield make_chunk([choice], usage(sum(generated.values())) if continuous else None)
    if include_usage:
        yield make_chunk([], usage(sum(generated.values())))
    yield SSE_DONE


async def respond(
    engine: AsyncEngine,
    raw: Request,
    specs: list[Any],  # RequestSpec
    streaming: bool,
    chunks: Callable[[RequestStream], AsyncIterator[str]],
    full: Callable[[dict[str, RequestOutput]], dict[str, Any]],
) -> Response:
    """Submit `specs`; an SSE response of `chunks(stream)`, or `full` of the final outputs by request id.
    A client that disconnects first gets 499: collecting is cancelled, which aborts its engine requests."""
    try:
        stream = await engine.add_requests(specs)
    except Exception as e:  # noqa: BLE001 - engine_error re-raises what it does not map
        raise engine_error(e) from None
    if streaming:
        return StreamingResponse(guarded_stream(chunks(stream), stream.close), media_type="text/event-stream")

    async def collect() -> dict[str, RequestOutput]:
        try:
            return {output.request_id: output async for output in stream}
        finally:
            stream.close()

    async def watch() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499) if task.cancelled() else JSONResponse(full(task.result()))


async def guarded_stream(chunks: AsyncIterator[str], close: Callable[[], None]) -> AsyncIterator[str]:
    """SSE body: an engine failure mid-stream becomes an error event; leaving early aborts."""
    try:
        async for chunk in chunks:
            yield chunk
    except (EngineDeadError, EngineOverloadedError) as e:
        yield sse(unavailable(str(e)).body())
        yield SSE_DONE
    except Exception:
        logger.exception("error while streaming a response")
        yield sse(INTERNAL_ERROR.body())
        yield SSE_DONE
    finally:
        close()
