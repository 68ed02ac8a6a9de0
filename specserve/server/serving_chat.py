"""POST /v1/chat/completions: messages rendered with the model's chat template."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from specserve.engine.async_engine import AsyncEngine, RequestSpec, RequestStream
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.server import protocol as proto
from specserve.server import serving_common as common
from specserve.server.serving_common import MIN_LOGPROB, APIError, floor

# Arguments of apply_chat_template a client must not override through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "tokenize", "add_generation_prompt", "return_dict", "return_tensors"}
_RESERVED_TEMPLATE_KWARGS |= {"padding", "truncation", "max_length", "chat_template", "tools", "documents"}
_RESERVED_TEMPLATE_KWARGS |= {"tokenizer_kwargs", "continue_final_message"}


def render_chat(
    engine: AsyncEngine, messages: list[proto.ChatMessage], add_generation_prompt: bool, req: Any = None
) -> list[int]:
    """Validate messages and apply the chat template (`req`'s chat_template, else the model's); the
    text is tokenized without special tokens (the template holds BOS) unless `req.add_special_tokens`.
    `req`: a ChatCompletionRequest, whose template kwargs and continue_final_message apply."""
    template_kwargs, chat_template = getattr(req, "chat_template_kwargs", None), getattr(req, "chat_template", None)
    _check_messages(messages)
    tokenizer = common.require_tokenizer(engine, "messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        msg = "this model has no chat template; use /v1/completions or send chat_template"
        raise APIError(msg, param="messages", code="unsupported")
    conversation = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    custom = {"chat_template": chat_template} if chat_template is not None else {}
    param = "chat_template" if custom else "messages"
    opened = {"continue_final_message": True} if req and req.continue_final_message else {}
    try:
        kw = {"tokenize": False, "add_generation_prompt": add_generation_prompt, **custom, **opened, **extra}
        text = tokenizer.apply_chat_template(conversation, **kw)
    except jinja2.TemplateSyntaxError as e:
        raise APIError(f"chat_template is not a valid Jinja template: {e}", param=param) from None
    except Exception as e:  # noqa: BLE001 - jinja errors (role order, ...) are the client's
        which = "the given chat_template" if custom else "the chat template"
        raise APIError(f"messages could not be rendered with {which}: {e}", param=param) from None
    return tokenizer.encode(text, add_special_tokens=bool(req and req.add_special_tokens))


def _check_messages(messages: list[proto.ChatMessage]) -> None:
    if not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if m.tool_calls or m.function_call is not None:
            field = "tool_calls" if m.tool_calls else "function_call"
            msg = f"messages.{i}.{field}: tool calls are not supported by this server"
            raise APIError(msg, param="messages", code="unsupported")
        if m.role != "assistant" and m.content is None:
            raise APIError(f"messages.{i}.content is required for role {m.role!r}", param=f"messages.{i}.content")


def _logprobs(engine: AsyncEngine, c: CompletionOutput, start: int, req: proto.ChatCompletionRequest) -> Any:
    """None unless requested; return_tokens_as_token_ids spells tokens "token_id:{id}" (bytes stay the text's)."""
    if not req.logprobs:
        return None
    as_ids, content = req.return_tokens_as_token_ids, []
    for tid, top, sampled, tok, text in common.generated_tokens(engine, c, start, as_ids):
        tops = []
        for t, lp in sorted(top.items(), key=lambda kv: -kv[1].logprob)[: req.top_logprobs or 0]:
            shown, t_text = common.logprob_token(engine, t, lp, as_ids)
            tops.append(
                proto.TopLogprob(token=shown, logprob=floor(lp.logprob), bytes=common.token_bytes(engine, t, t_text))
            )
        logprob = floor(sampled.logprob) if sampled else MIN_LOGPROB
        bytes_ = common.token_bytes(engine, tid, text)
        content.append(proto.ChatTokenLogprob(token=tok, logprob=logprob, bytes=bytes_, top_logprobs=tops))
    return {"content": content}


_CONTINUE = "continue_final_message"


def _validate(req: proto.ChatCompletionRequest) -> None:
    if req.tools:
        raise APIError("tools are not supported by this server", param="tools", code="unsupported")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(f"{_CONTINUE} needs add_generation_prompt to be false (as vLLM)", param=_CONTINUE)
    if req.continue_final_message and req.messages and req.messages[-1].role != "assistant":
        raise APIError(f"{_CONTINUE} needs the last message to be the assistant's", param=_CONTINUE)


async def create_chat_completion(engine: AsyncEngine, req: proto.ChatCompletionRequest, raw: Request) -> Response:
    common.check_model(engine, req.model)
    _validate(req)
    keep = common.truncation_size(req.truncate_prompt_tokens, engine.max_model_len)
    if keep is None and req.messages:
        common.check_prompt_chars(engine, sum(len(m.text()) for m in req.messages), "messages")
    prompt_ids = await asyncio.to_thread(render_chat, engine, req.messages, req.add_generation_prompt, req)
    if keep is not None:
        prompt_ids = prompt_ids[-keep:]  # vLLM's truncate_prompt_tokens: the last k tokens
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = common.build_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs")
    params = common.fit_context(params, [len(prompt_ids)], engine.max_model_len, "messages")
    reply_id = proto.random_id("chatcmpl")
    specs = [RequestSpec(reply_id, {"prompt_token_ids": prompt_ids}, params)]
    chunks = lambda stream: _stream(engine, req, stream, reply_id, len(prompt_ids))
    full = lambda finals: _full_response(engine, req, finals[reply_id], reply_id)
    return await common.respond(engine, raw, specs, req.stream, chunks, full)


def _echo_text(req: proto.ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: a final message in the response's role (assistant) prefixes the reply."""
    last = req.messages[-1] if req.messages else None
    return last.text() if req.echo and last is not None and last.role == "assistant" else ""


def _choice(engine: AsyncEngine, req: Any, c: CompletionOutput, text: str, start: int = -1) -> dict[str, Any]:
    """A response choice (`message`), or a stream choice (`delta`) of the tokens from `start` on."""
    lp = _logprobs(engine, c, max(start, 0), req)
    common_fields = {"logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if start < 0:
        return proto.ChatChoice(index=c.index, message=proto.ChatResponseMessage(content=text), **common_fields)
    return proto.ChatStreamChoice(index=c.index, delta=proto.DeltaMessage(content=text), **common_fields)


def _full_response(
    engine: AsyncEngine, req: proto.ChatCompletionRequest, final: RequestOutput, reply_id: str
) -> dict[str, Any]:
    choices = [_choice(engine, req, c, _echo_text(req) + c.text) for c in final.outputs]
    usage = proto.usage_info(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs))
    return proto.ChatCompletionResponse(id=reply_id, model=engine.model_name, choices=choices, usage=usage)


async def _stream(
    engine: AsyncEngine, req: proto.ChatCompletionRequest, stream: RequestStream, reply_id: str, num_prompt_tokens: int
) -> AsyncIterator[str]:
    kw = {"id": reply_id, "created": int(time.time()), "model": engine.model_name}
    chunk = lambda choices, usage=None: common.sse(proto.ChatCompletionChunk(**kw, choices=choices, usage=usage))
    choice = lambda u: _choice(engine, req, u[2], u[3], u[4])
    # The role comes first, as OpenAI sends it (with the echoed final assistant message).
    echo = _echo_text(req)
    for i in range(req.n):
        yield chunk([proto.ChatStreamChoice(index=i, delta=proto.DeltaMessage(role="assistant", content=echo))])
    usage = functools.partial(proto.usage_info, num_prompt_tokens)
    async for piece in common.stream_chunks(req, stream, lambda o, c: c.index, chunk, choice, usage):
        yield piece
