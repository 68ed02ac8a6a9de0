"""LLM: the offline API, a thin loop over Engine.step() (vLLM's shape)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from specserve.config import DEFAULT_MODEL, EngineConfig
from specserve.engine.engine import Engine
from specserve.metrics.stats import Metric
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, progress: bool = True, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = Engine(self.config, progress=progress)
        self.engine.stream_outputs = False  # generate() returns whole outputs
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs in prompt order. All prompts are validated before any runs."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts.")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            self.engine.abort_request(added, emit_output=False)  # all or nothing
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation through the chat template; outputs report the rendered prompt.
        continue_final_message leaves the last (assistant) message open for the model to go on."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        opts = (add_generation_prompt, chat_template, continue_final_message, chat_template_kwargs)
        prompts = [dict(zip(("prompt", "prompt_token_ids"), self._render_chat(c, *opts))) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        opts = (add_generation_prompt, chat_template, continue_final_message, chat_template_kwargs)
        return self._render_chat(messages, *opts)[1]

    def _render_chat(
        self, messages: list[dict[str, str]], add_prompt: bool, template: str | None, cont: bool, kw: dict | None
    ) -> tuple[str, list[int]]:
        """The rendered text and its token ids (the template holds BOS and friends: none added again)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it has no chat template.")
        if not messages:
            raise ValueError("messages must not be empty.")
        if cont and (add_prompt or messages[-1].get("role") != "assistant"):
            msg = "continue_final_message needs add_generation_prompt=False and a last message from the assistant."
            raise ValueError(msg)
        kw = ({"continue_final_message": True} if cont else {}) | (kw or {})
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_prompt, chat_template=template, **kw
        )
        return text, list(tok.encode(text, add_special_tokens=False))

    def get_metrics(self) -> list[Metric]:
        """The same series the server exports, named `specserve:<name>`."""
        for m in (out := self.engine.stats.snapshot()):
            m.name = f"specserve:{m.name}"
        return out
