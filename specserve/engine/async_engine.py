"""AsyncEngine: the synchronous Engine driven by one background thread, for the asyncio server.

Threading contract: every call into `Engine` happens on the engine thread (the asyncio side enqueues
add / abort commands, applied between steps; the command list under `_cond` is the only shared state);
outputs go back with one `loop.call_soon_threadsafe` per step; streams live on the event loop thread only."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop died or was shut down; no request can be served (HTTP 503)."""


class RequestSpec(NamedTuple):
    request_id: str
    prompt: PromptType
    params: SamplingParams


class _AddCommand(NamedTuple):
    requests: Sequence[RequestSpec]
    future: concurrent.futures.Future


class _AbortCommand(NamedTuple):
    request_ids: list[str]


class RequestStream:
    """Outputs of one or more admitted requests (a batch or a single prompt), on the loop thread."""

    def __init__(self, owner: AsyncEngine, request_ids: Sequence[str]) -> None:
        self._owner = owner
        self.request_ids = list(request_ids)
        self._pending = set(request_ids)  # not yet finished
        self._updates: dict[str, RequestOutput] = {}
        self._event = asyncio.Event()
        self._error: BaseException | None = None

    def _put(self, output: RequestOutput) -> None:
        self._updates.pop(output.request_id, None)  # move to the end: keep arrival order
        self._updates[output.request_id] = output
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._updates:
            if not self._pending:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            self._event.clear()
            await self._event.wait()
        rid = next(iter(self._updates))
        output = self._updates.pop(rid)
        if output.finished:
            self._pending.discard(rid)
            self._owner._unregister([rid])
        return output

    def close(self) -> None:
        """Abort whatever has not finished (client went away); safe to call more than once."""
        if self._pending:
            ids = list(self._pending)
            self._pending.clear()
            self._owner._unregister(ids)
            self._owner.abort(ids)


class AsyncEngine:
    def __init__(self, engine: Engine, max_num_queued_requests: int | None = None) -> None:
        self._engine = engine
        self.max_num_queued_requests = max_num_queued_requests
        self.config, self.tokenizer, self.stats = engine.config, engine.tokenizer, engine.stats  # read-only facts
        self.model_name, self.vocab_size = engine.model_name, engine.vocab_size
        self.max_model_len = engine.max_model_len

        self._cond = threading.Condition()
        self._commands: list[_AddCommand | _AbortCommand] = []
        self._stop = False
        self._dead: EngineDeadError | None = None
        self._accepting = True
        self._live_ids: set[str] = set()  # engine-thread only: ids the engine holds
        self._streams: dict[str, RequestStream] = {}  # loop-thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> AsyncEngine:
        """Load the model (with a progress bar) and start the engine thread."""
        from specserve.engine.engine import Engine  # heavy: torch + model code

        return cls(Engine(config, progress=progress), max_num_queued_requests=config.scheduler.max_num_queued_requests)

    def encode(self, text: str) -> list[int]:
        return self._engine.encode(text)

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    async def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")

    async def add_requests(self, requests: Sequence[RequestSpec]) -> RequestStream:
        """Admit all of `requests` or none of them; return their (merged) output stream."""
        if not self._accepting:
            raise EngineDeadError("server is shutting down")
        await self.check_health()
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncEngine is bound to another event loop")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
            raise ValueError(f"request_id is already in use: {ids}")
        stream = RequestStream(self, ids)
        for rid in ids:  # before the command: outputs may arrive right after admission
            self._streams[rid] = stream
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_AddCommand(list(requests), future))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            stream.close()  # the caller left while we waited: abort whatever got admitted
            raise
        except BaseException:
            self._unregister(ids)
            raise
        return stream

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request; closing the iterator early aborts it."""
        stream = await self.add_requests([RequestSpec(request_id, prompt, params)])
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); KV blocks are freed next tick."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids and self._dead is None:
            self._submit(_AbortCommand(ids))

    async def drain(self, timeout: float) -> None:
        """Stop accepting; give in-flight requests `timeout` s to finish, then abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and self._dead is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams and self._dead is None:
            logger.info("aborting %d in-flight request(s) for shutdown", len(self._streams))
            self.abort(list(self._streams))
            deadline = time.monotonic() + 2.0
            while self._streams and self._dead is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Drain within `timeout`, fail whatever is still streaming, stop and join the thread."""
        await self.drain(max(0.0, timeout - 2.0))
        self._fail_all(EngineDeadError("server is shutting down"))
        await asyncio.to_thread(self.close, 2.0)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the engine thread (aborting what it still holds) and join it."""
        self._accepting = False
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.1f s", timeout)

    def _unregister(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self._streams.pop(rid, None)

    def _submit(self, command: _AddCommand | _AbortCommand) -> None:
        with self._cond:
            if self._stop or self._dead is not None:
                if isinstance(command, _AddCommand):
                    command.future.set_exception(self._dead or EngineDeadError("engine is stopped"))
                return
            self._commands.append(command)
            self._cond.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Loop thread: hand each output to its stream (unknown ids were aborted; drop them)."""
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream._put(output)

    def _fail_all(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream._fail(error)
        self._streams.clear()

    def _call_on_loop(self, fn: Any, *args: Any) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(fn, *args)

    # -- engine thread --
    def _run(self) -> None:
        try:
            busy = False
            while True:
                commands = self._wait_for_work(busy)
                if commands is None:
                    break
                self._apply(commands)
                if self._engine.has_unfinished_requests():
                    outputs = self._engine.step()
                    self._live_ids.difference_update(o.request_id for o in outputs if o.finished)
                    if outputs:
                        self._call_on_loop(self._deliver, outputs)  # fresh objects each step
                busy = self._engine.has_unfinished_requests()
                if not busy:
                    self._refresh_gauges()  # the engine sets them in step(); none runs while idle
            self._abort_everything()
        except BaseException as e:  # noqa: BLE001 - any failure must reach the clients
            self._die(e)

    def _wait_for_work(self, busy: bool) -> list[_AddCommand | _AbortCommand] | None:
        with self._cond:
            while not self._commands and not busy and not self._stop:
                self._cond.wait()
            commands, self._commands, stop = self._commands, [], self._stop
        if stop:
            _fail_adds(commands, EngineDeadError("engine is stopping"))
            return None
        return commands

    def _apply(self, commands: list[_AddCommand | _AbortCommand]) -> None:
        for cmd in commands:
            if isinstance(cmd, _AbortCommand):
                ids = [i for i in cmd.request_ids if i in self._live_ids]
                if ids:  # frees the blocks now; the next step reports the abort and refreshes the gauges
                    self._engine.abort_request(ids)
                    self._live_ids.difference_update(ids)
            else:
                self._admit(cmd)

    def _admit(self, cmd: _AddCommand) -> None:
        """Add every request of `cmd` or, on the first error, roll back the ones already added."""
        limit = self.max_num_queued_requests
        num_new = sum(spec.params.n for spec in cmd.requests)  # the scheduler queues each of n
        if limit is not None and self._engine.num_would_wait(num_new) > limit:
            cmd.future.set_exception(
                EngineOverloadedError(f"server overloaded: more than {limit} request(s) would be waiting; retry later")
            )
            return
        added: list[str] = []
        try:
            for spec in cmd.requests:
                self._engine.add_request(spec.request_id, spec.prompt, spec.params)
                added.append(spec.request_id)
        except Exception as e:  # noqa: BLE001 - reported to the caller, engine stays up
            if added:
                self._engine.abort_request(added, emit_output=False)
            cmd.future.set_exception(e)
            return
        self._live_ids.update(added)
        cmd.future.set_result(None)

    def _refresh_gauges(self) -> None:
        """Only when the engine holds no request (or is stopping): nothing runs or waits."""
        self.stats.set("num_requests_running", 0)
        self.stats.set("num_requests_waiting", 0)
        self.stats.set("kv_cache_usage_perc", self._engine.kv.usage())

    def _abort_everything(self) -> None:
        if self._live_ids:
            self._engine.abort_request(list(self._live_ids))
            self._live_ids.clear()
        self._refresh_gauges()

    def _die(self, error: BaseException) -> None:
        logger.exception("engine loop died: %s", error)
        dead = EngineDeadError(f"engine loop died: {type(error).__name__}: {error}")
        with self._cond:
            self._dead = dead
            pending, self._commands = self._commands, []
        _fail_adds(pending, dead)
        self._call_on_loop(self._fail_all, dead)


def _fail_adds(commands: list[_AddCommand | _AbortCommand], error: BaseException) -> None:
    for cmd in commands:
        if isinstance(cmd, _AddCommand):
            cmd.future.set_exception(error)
