"""Pydantic models of the OpenAI API with vLLM's extra fields. Unknown fields are ignored; JSON null
for an optional field means "not given". Shapes and types only: SamplingParams checks ranges."""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _accepts_none(annotation: Any) -> bool:
    return annotation is Any or annotation is None or type(None) in get_args(annotation)


@functools.cache
def _null_means_default(cls: type[BaseModel]) -> frozenset[str]:
    """Optional fields of `cls` whose type has no None: a JSON null there means the default."""
    return frozenset(
        name for name, f in cls.model_fields.items() if not f.is_required() and not _accepts_none(f.annotation)
    )


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _drop_null_optionals(cls, data: Any) -> Any:
        if isinstance(data, dict):
            names = _null_means_default(cls)
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
            raise PydanticCustomError(
                "invalid_value", "must be a string, a list of strings, a list of token ids or a list of token-id lists"
            ) from None


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
            if isinstance(value, list) and any(
                isinstance(p, dict) and p.get("type") not in ("text", None) for p in value
            ):
                raise PydanticCustomError("unsupported", "only text content parts are supported") from None
            raise PydanticCustomError(
                "invalid_value", "must be a string or a list of text parts ({'type': 'text', 'text': ...})"
            ) from None

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


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


def _now() -> int:
    return int(time.time())


class _Choice(BaseModel):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Reply(BaseModel):
    id: str
    created: int = Field(default_factory=_now)
    model: str


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    # vLLM's: per prompt token (None for the first) {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(_Reply):
    object: str = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatResponseMessage(DeltaMessage):
    role: str | None = "assistant"


class ChatChoice(_Choice):
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Reply):
    object: str = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatStreamChoice(_Choice):
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Reply):
    object: str = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
