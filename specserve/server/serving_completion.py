"""POST /v1/completions: string, batch of strings, token ids, or batch of token id lists."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from specserve.engine.async_engine import AsyncEngine, RequestSpec, RequestStream
from specserve.outputs import CompletionOutput, Logprob, RequestOutput
from specserve.server import protocol as proto
from specserve.server import serving_common as common
from specserve.server.serving_common import APIError, floor


@dataclass
class _Prompt:
    text: str | None  # None when the client sent token ids (decoded lazily for echo)
    token_ids: list[int]


@dataclass
class _Reply:
    """Per-HTTP-request state shared by the streaming and the non-streaming paths."""

    engine: AsyncEngine
    req: proto.CompletionRequest
    prompts: list[_Prompt]
    request_ids: list[str]
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    text_offsets: dict[int, int] = field(default_factory=dict)

    def choice_index(self, output: RequestOutput, completion: CompletionOutput) -> int:
        return self.request_ids.index(output.request_id) * self.req.n + completion.index

    def prompt_of(self, output: RequestOutput) -> _Prompt:
        return self.prompts[self.request_ids.index(output.request_id)]

    def echo_text(self, prompt: _Prompt) -> str:
        if prompt.text is None:
            prompt.text = common.require_tokenizer(self.engine, "echo").decode(prompt.token_ids)
        return prompt.text

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> str:
        kw = {"id": self.id, "created": self.created, "model": self.engine.model_name}
        return common.sse(proto.CompletionResponse(**kw, choices=choices, usage=usage))

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return proto.usage_info(sum(len(p.token_ids) for p in self.prompts), completion_tokens)

    def choice(self, u: common.Update) -> dict[str, Any]:
        """The choice of an update; its first one carries the echoed prompt and prompt_logprobs."""
        index, output, c, delta, start, first = u
        echo = self.req.echo and first
        return proto.CompletionChoice(
            index=index,
            text=(self.echo_text(self.prompt_of(output)) if echo else "") + delta,
            logprobs=self.logprobs(index, c, start, output if echo else None),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_logprobs=_prompt_logprobs(self.req, output) if first else None,
        )

    def logprobs(
        self, index: int, c: CompletionOutput, start: int, echoed: RequestOutput | None = None
    ) -> dict[str, Any] | None:
        """Logprobs of tokens [start, len(token_ids)), after the prompt's when `echoed` (its prompt is
        echoed in this chunk; vLLM: the first prompt token has no logprob). Text offsets continue across
        chunks and stay in the text when tokens are shown as "token_id:{id}"."""
        if self.req.logprobs is None:
            return None
        engine, as_ids, out = self.engine, self.req.return_tokens_as_token_ids, proto.CompletionLogprobs()
        offset = self.text_offsets.get(index, 0)
        scored = list(common.generated_tokens(engine, c, start, as_ids))
        if echoed is not None:
            tops = echoed.prompt_logprobs or []
            scored = [*common.scored_tokens(engine, echoed.prompt_token_ids, tops, as_ids, None), *scored]
        for _, top, sampled, tok, text in scored:
            out["tokens"].append(tok)
            out["token_logprobs"].append(floor(sampled.logprob) if sampled else None)
            shown = None if top is None else {self._shown(t, lp): floor(lp.logprob) for t, lp in top.items()}
            out["top_logprobs"].append(shown)  # top-n and the token itself, as vLLM
            out["text_offset"].append(offset)
            offset += len(text)
        self.text_offsets[index] = offset
        return out

    def _shown(self, token_id: int, lp: Logprob) -> str:
        return common.logprob_token(self.engine, token_id, lp, self.req.return_tokens_as_token_ids)[0]


def _prompts(engine: AsyncEngine, req: proto.CompletionRequest) -> list[_Prompt]:
    """The request's prompts as token ids: text tokenized (with the tokenizer's special tokens when
    add_special_tokens), then left-truncated to the last truncate_prompt_tokens tokens (vLLM)."""
    keep = common.truncation_size(req.truncate_prompt_tokens, engine.max_model_len)
    prompt = req.prompt
    prompts: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not prompts:
        raise APIError("prompt must not be empty", param="prompt")
    out = []
    for p in prompts:
        text = p if isinstance(p, str) else None
        if text is not None:
            tokenizer = common.require_tokenizer(engine, "prompt")
            if keep is None:  # truncation keeps the last tokens of a longer text
                common.check_prompt_chars(engine, len(p), "prompt")
            # with special tokens: the engine's own tokenization of a text prompt
            ids = engine.encode(p) if p and req.add_special_tokens else tokenizer.encode(p, add_special_tokens=False)
        else:
            common.check_token_ids(p, engine.vocab_size, "prompt")
            ids = p
        if keep is not None and len(ids) > keep:
            text, ids = None, ids[-keep:]  # echo shows what the model saw: the kept tokens, decoded
        out.append(_Prompt(text, list(ids)))
    return out


async def create_completion(engine: AsyncEngine, req: proto.CompletionRequest, raw: Request) -> Response:
    common.check_model(engine, req.model)
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of must equal n (best-of sampling is not supported)", param="best_of", code="unsupported")
    if req.echo:
        common.require_tokenizer(engine, "echo")
    prompts = await asyncio.to_thread(_prompts, engine, req)
    if len(prompts) * req.n > common.MAX_N:
        raise APIError(f"too many completions in one request (prompts * n > {common.MAX_N})", param="n")
    params = common.build_params(req, req.max_tokens, req.logprobs)
    # echo with logprobs scores the prompt too (vLLM; lm-eval's loglikelihood requests rely on it).
    wanted = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    if wanted:
        if not 0 <= max(wanted) <= common.MAX_LOGPROBS:
            msg = f"prompt_logprobs must be between 0 and {common.MAX_LOGPROBS}, got {max(wanted)}"
            raise APIError(msg, param="prompt_logprobs")
        params = params.clone(prompt_logprobs=max(wanted))
    params = common.fit_context(params, [len(p.token_ids) for p in prompts], engine.max_model_len, "prompt")
    reply_id = proto.random_id("cmpl")
    ids = [f"{reply_id}-{i}" for i in range(len(prompts))]
    specs = [RequestSpec(rid, {"prompt_token_ids": p.token_ids}, params) for rid, p in zip(ids, prompts)]
    reply = _Reply(engine, req, prompts, ids, reply_id)
    full = lambda finals: _full_response(reply, finals)
    return await common.respond(engine, raw, specs, req.stream, lambda stream: _stream(reply, stream), full)


def _full_response(reply: _Reply, finals: dict[str, RequestOutput]) -> dict[str, Any]:
    outputs = [finals[rid] for rid in reply.request_ids]
    updates = [(reply.choice_index(o, c), o, c, c.text, 0, True) for o in outputs for c in o.outputs]
    choices = sorted(map(reply.choice, updates), key=lambda ch: ch["index"])
    usage = reply.usage(sum(len(c.token_ids) for o in outputs for c in o.outputs))
    return proto.CompletionResponse(id=reply.id, model=reply.engine.model_name, choices=choices, usage=usage)


def _stream(reply: _Reply, stream: RequestStream) -> AsyncIterator[str]:
    return common.stream_chunks(
        reply.req, stream, reply.choice_index, reply.chunk, reply.choice, reply.usage, keep_first=reply.req.echo
    )


def _prompt_logprobs(req: proto.CompletionRequest, output: RequestOutput) -> list[Any] | None:
    """vLLM's `prompt_logprobs` of a choice, when the request asked for them."""
    if req.prompt_logprobs is None or output.prompt_logprobs is None:
        return None
    entry = lambda lp: {"logprob": floor(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
    return [e and {str(t): entry(lp) for t, lp in e.items()} for e in output.prompt_logprobs]
