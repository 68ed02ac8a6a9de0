"""Pydantic models of the OpenAI API with vLLM's extra fields. Unknown fields are ignored; JSON null
for an optional field means "not given". Shapes and types only: SamplingParams checks ranges."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@functools.cache
def _null_means_default(cls: type[BaseModel]) -> frozenset[str]:
    """Optional fields of `cls` whose type has no None: a JSON null there means the default."""
    nullable = lambda t: t is Any or t is None or type(None) in get_args(t)
    return frozenset(n for n, f in cls.model_fields.items() if not f.is_required() and not nullable(f.annotation))


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _drop_null_optionals(cls, data: Any) -> Any:
        names = _null_means_default(cls) if isinstance(data, dict) else ()
        if any(data.get(name, 0) is None for name in names):
            data = {k: v for k, v in data.items() if not (v is None and k in names)}
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras (extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, strict=True)  # last k tokens; -1: max_model_len
    return_tokens_as_token_ids: bool = False
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_extras(self) -> dict[str, Any]:
        names = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions (chat: the rest of the context)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extra field: each prompt token's logprob and top-n
    add_special_tokens: bool = True  # vLLM's: tokenize text prompts with the tokenizer's BOS etc.

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            msg = "must be a string, a list of strings, a list of token ids or a list of token-id lists"
            raise PydanticCustomError("invalid_value", msg) from None


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None  # tool_calls / function_call: seen only to be refused

    @field_validator("content", mode="wrap")
    @classmethod
    def _text_parts_only(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            parts = value if isinstance(value, list) else []
            if any(isinstance(p, dict) and p.get("type") not in ("text", None) for p in parts):
                raise PydanticCustomError("unsupported", "only text content parts are supported") from None
            msg = "must be a string or a list of text parts ({'type': 'text', 'text': ...})"
            raise PydanticCustomError("invalid_value", msg) from None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model continues the last (assistant) message
    chat_template: str | None = None  # a Jinja template used instead of the model's
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # vLLM's: BOS etc. on top of what the template renders
    echo: bool = False  # vLLM's: a final assistant message's content prefixes the reply


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


def _shape(fields: str, **defaults: Any) -> Callable[..., dict[str, Any]]:
    """A response object's builder: the keys `fields` in this order, each None unless given or defaulted
    (a callable default is called: list, _now)."""
    names = fields.split()

    def build(**kw: Any) -> dict[str, Any]:
        return {n: kw[n] if n in kw else (d() if callable(d := defaults.get(n)) else d) for n in names}

    return build


def _now() -> int:
    return int(time.time())


def usage_info(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


_REPLY = "id object created model choices usage"
ErrorInfo = _shape("message type param code")
# prompt_logprobs (vLLM's): per prompt token (None for the first) {token id: {logprob, rank, decoded_token}}
CompletionChoice = _shape("index text logprobs finish_reason stop_reason prompt_logprobs")
_LOGPROB_LISTS = "text_offset token_logprobs tokens top_logprobs"
CompletionLogprobs = _shape(_LOGPROB_LISTS, **dict.fromkeys(_LOGPROB_LISTS.split(), list))
CompletionResponse = _shape(_REPLY, object="text_completion", created=_now)
TopLogprob = _shape("token logprob bytes")
ChatTokenLogprob = _shape("token logprob bytes top_logprobs", top_logprobs=list)
ChatResponseMessage = _shape("role content", role="assistant")
DeltaMessage = _shape("role content")
ChatChoice = _shape("index message logprobs finish_reason stop_reason")
ChatStreamChoice = _shape("index delta logprobs finish_reason stop_reason")
ChatCompletionResponse = _shape(_REPLY, object="chat.completion", created=_now)
ChatCompletionChunk = _shape(_REPLY, object="chat.completion.chunk")
ModelCard = _shape("id object created owned_by root max_model_len", object="model", created=_now, owned_by="specserve")
ModelList = _shape("object data", object="list")
