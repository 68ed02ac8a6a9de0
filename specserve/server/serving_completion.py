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

    def chunk(self, choices: list[proto.CompletionChoice], usage: proto.UsageInfo | None) -> str:
        model = self.engine.model_name
        return common.sse(
            proto.CompletionResponse(id=self.id, created=self.created, model=model, choices=choices, usage=usage)
        )

    def usage(self, completion_tokens: int) -> proto.UsageInfo:
        return proto.UsageInfo.of(sum(len(p.token_ids) for p in self.prompts), completion_tokens)

    def logprobs(
        self, index: int, c: CompletionOutput, start: int, echoed: RequestOutput | None = None
    ) -> proto.CompletionLogprobs | None:
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
            out.tokens.append(tok)
            out.token_logprobs.append(floor(sampled.logprob) if sampled else None)
            shown = None if top is None else {self._shown(t, lp): floor(lp.logprob) for t, lp in top.items()}
            out.top_logprobs.append(shown)  # top-n and the token itself, as vLLM
            out.text_offset.append(offset)
            offset += len(text)
        self.text_offsets[index] = offset
        return out

    def _shown(self, token_id: int, lp: Logprob) -> str:
        return common.logprob_token(self.engine, token_id, lp, self.req.return_tokens_as_token_ids)[0]


def _prompts(engine: AsyncEngine, req: proto.CompletionRequest) -> list[_Prompt]:
    """The request's prompts as token ids: text tokenized (with the tokenizer's special tokens when
    add_special_tokens), then left-truncated to the last truncate_prompt_tokens tokens (vLLM)."""
    prompt = req.prompt
    keep = common.truncation_size(req.truncate_prompt_tokens, engine.max_model_len)
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]  # one tokenized prompt
    out = []
    for p in prompt:
        if isinstance(p, str):
            tokenizer = common.require_tokenizer(engine, "prompt")
            if keep is None:  # truncation keeps the last tokens of a longer text
                common.check_prompt_chars(engine, len(p), "prompt")
            if not p:
                ids = []
            elif req.add_special_tokens:
                ids = engine.encode(p)  # the engine's own tokenization of a text prompt
            else:
                ids = list(tokenizer.encode(p, add_special_tokens=False))
            prompt_item = _Prompt(p, ids)
        else:
            common.check_token_ids(p, engine.vocab_size, "prompt")
            prompt_item = _Prompt(None, list(p))
        if keep is not None and len(prompt_item.token_ids) > keep:
            # echo shows what the model saw: the kept tokens, decoded
            prompt_item = _Prompt(None, prompt_item.token_ids[-keep:])
        out.append(prompt_item)
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
            raise APIError(
                f"prompt_logprobs must be between 0 and {common.MAX_LOGPROBS}, got {max(wanted)}",
                param="prompt_logprobs",
            )
        params = params.clone(prompt_logprobs=max(wanted))
    params = common.fit_context(params, [len(p.token_ids) for p in prompts], engine.max_model_len, "prompt")
    reply_id = proto.random_id("cmpl")
    ids = [f"{reply_id}-{i}" for i in range(len(prompts))]
    specs = [RequestSpec(rid, {"prompt_token_ids": p.token_ids}, params) for rid, p in zip(ids, prompts)]
    stream = await common.submit(engine, specs)
    reply = _Reply(engine, req, prompts, ids, reply_id)
    return await common.respond(
        raw, stream, req.stream, lambda: _stream(reply, stream), lambda f: _full_response(reply, f)
    )


def _full_response(reply: _Reply, finals: dict[str, RequestOutput]) -> proto.CompletionResponse:
    choices, num_generated = [], 0
    for rid in reply.request_ids:
        output = finals[rid]
        for c in output.outputs:
            index = reply.choice_index(output, c)
            text = (reply.echo_text(reply.prompt_of(output)) if reply.req.echo else "") + c.text
            logprobs = reply.logprobs(index, c, 0, output if reply.req.echo else None)
            choices.append(
                proto.CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=_prompt_logprobs(reply.req, output),
                )
            )
            num_generated += len(c.token_ids)
    choices.sort(key=lambda ch: ch.index)
    return proto.CompletionResponse(
        id=reply.id, model=reply.engine.model_name, choices=choices, usage=reply.usage(num_generated)
    )


def _stream(reply: _Reply, stream: RequestStream) -> AsyncIterator[str]:
    req = reply.req

    def choice(u: common.Update) -> proto.CompletionChoice:
        index, output, c, delta, start, first = u
        echo = req.echo and first
        return proto.CompletionChoice(
            index=index,
            text=(reply.echo_text(reply.prompt_of(output)) if echo else "") + delta,
            logprobs=reply.logprobs(index, c, start, output if echo else None),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_logprobs=_prompt_logprobs(req, output) if first else None,
        )

    return common.stream_chunks(req, stream, reply.choice_index, reply.chunk, choice, reply.usage, keep_first=req.echo)


def _prompt_logprobs(
    req: proto.CompletionRequest, output: RequestOutput
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` of a choice, when the request asked for them."""
    if req.prompt_logprobs is None or output.prompt_logprobs is None:
        return None
    return [
        e
        and {
            str(t): {"logprob": floor(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in e.items()
        }
        for e in output.prompt_logprobs
    ]
