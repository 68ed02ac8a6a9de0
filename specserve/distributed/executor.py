"""Rank 0's side of tensor parallelism: `TPExecutor`, a drop-in for `ModelRunner` that broadcasts each step's
`HostBatch` on the control group and runs rank 0's own forward. A dead rank never hangs the engine: children are
polled before and (on CUDA) during each step, which then raises `WorkerDiedError`, as does every later one."""

from __future__ import annotations

import datetime
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from specserve.config import EngineConfig
from specserve.distributed.parallel_layers import check_tp_size
from specserve.distributed.parallel_state import TPGroup, adopt_default_group, init_tp_group, release_tp_group
from specserve.distributed.worker import Shutdown, StepMessage, WorkerProcs, build_rank_runner, release_cuda_graphs
from specserve.model.arch import ModelArch
from specserve.runner.batch import build_host_batch
from specserve.runner.model_runner import ModelRunner, StepOutput
from specserve.scheduler.scheduler import SchedulerOutput

STEP_TIMEOUT_S = 300.0  # one step (a first one compiles kernels); gloo and NCCL collectives fail after it too
START_TIMEOUT_S = 300.0  # until every worker reached the rendezvous store (interpreter + torch import)
_POLL_CHILDREN_S = 0.01


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the engine cannot continue."""


@dataclass(eq=False)
class _Shared:
    """What closing needs, without a reference to the executor (so a finalizer can hold it)."""

    group: TPGroup
    procs: WorkerProcs | None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one step or one shutdown at a time
    broken: str | None = None
    closed: bool = False
    runner: weakref.ref[ModelRunner] | None = None  # weakly: its CUDA graphs must go before the groups

    def release(self) -> None:
        """Kill what is left of the workers and drop graphs and groups; never blocks for long."""
        if self.procs is not None:
            self.procs.terminate()
        if self.broken is not None:
            release_tp_group(self.group)  # first: aborting ends kernels stuck on a dead peer
        runner = self.runner() if self.runner is not None else None
        if runner is not None and runner.graphs is not None:
            release_cuda_graphs(runner)
        release_tp_group(self.group)

    def close(self, timeout_s: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        got_lock = self.lock.acquire(timeout=timeout_s)
        try:
            if got_lock and self.broken is None:
                try:
                    self.group.broadcast_object(Shutdown())
                    if self.procs is not None:
                        self.procs.wait(timeout_s)
                except Exception:
                    self.broken = "a rank failed during shutdown"
            elif self.broken is None:  # a step still running on another thread: the groups are unusable
                self.broken = "closed while a step was running"
            self.release()
        finally:
            if got_lock:
                self.lock.release()


class TPExecutor(ModelRunner):
    """Rank 0's runner: same interface as ModelRunner; also drives ranks 1..N-1."""

    accepts_pending = False  # steps are broadcast as host batches: no placeholder fill

    def __init__(
        self, loaded, spec, num_blocks: int, device: torch.device, backend, *, group: TPGroup, procs: WorkerProcs | None
    ) -> None:
        super().__init__(loaded, spec, num_blocks, device, backend)
        self.group = group
        self.procs = procs
        self._shared = _Shared(group, procs)
        self._shared.runner = weakref.ref(self)
        self._finalizer = weakref.finalize(self, self._shared.close)

    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the spawned ranks (empty under torchrun)."""
        return self.procs.pids if self.procs is not None else {}

    def execute(self, sched: SchedulerOutput, block_ids_of, need_hidden: bool = False) -> StepOutput:
        host = build_host_batch(sched, block_ids_of, self.block_size)
        with self._shared.lock:
            self._check_usable()
            try:
                self.group.broadcast_object(StepMessage(host, need_hidden))
                out = self.execute_host(host, need_hidden)
                self._wait_for_step(out.logits)
            except BaseException as e:
                raise self._fail(e) from e
        return out

    def close(self) -> None:
        """Stop the workers (a Shutdown message, or kill after a failure) and drop the groups."""
        self._finalizer()

    def _check_usable(self) -> None:
        shared = self._shared
        if shared.closed:
            raise WorkerDiedError("the tensor-parallel executor is closed.")
        if shared.broken is None and self.procs is not None and self.procs.dead():
            raise self._fail(WorkerDiedError(f"tensor-parallel worker died: {self.procs.describe_dead()}"))
        if shared.broken is not None:
            raise WorkerDiedError(f"{shared.broken}; the engine cannot continue.")

    def _wait_for_step(self, logits: torch.Tensor) -> None:
        """CUDA: wait for the step, noticing a dead rank (an NCCL kernel waiting on it would block forever)."""
        if logits.device.type != "cuda":
            return  # gloo collectives are synchronous and fail on their own
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + STEP_TIMEOUT_S
        next_poll = time.monotonic() + _POLL_CHILDREN_S
        while not done.query():
            now = time.monotonic()
            if now >= next_poll:
                if self.procs is not None and self.procs.dead():
                    raise WorkerDiedError(f"tensor-parallel worker died: {self.procs.describe_dead()}")
                if now > deadline:
                    raise WorkerDiedError(f"a tensor-parallel step did not finish within {STEP_TIMEOUT_S:.0f} s")
                next_poll = now + _POLL_CHILDREN_S
            time.sleep(0)  # let the server's threads run

    def _fail(self, error: BaseException) -> BaseException:
        """Mark the executor broken and turn the failure into the error the engine reports."""
        shared, dead = self._shared, ""
        if self.procs is not None:
            self.procs.wait_any_dead(1.0)  # sockets close a moment before the exit shows: name the rank
            dead = self.procs.describe_dead()
        if isinstance(error, WorkerDiedError):
            shared.broken = str(error)
        elif dead:
            shared.broken = f"tensor-parallel worker died: {dead}"
        else:
            shared.broken = f"tensor-parallel step failed: {type(error).__name__}: {str(error)[:300]}"
        shared.release()
        return WorkerDiedError(f"{shared.broken}; the engine cannot continue.")


def check_tp_config(config: EngineConfig) -> None:
    """ValueError (naming the field) for what tensor parallelism cannot do; before any rank starts."""
    from specserve.model.loader import WeightSource

    hf_config = {**WeightSource.open(config.model).hf_config, **(config.model.hf_overrides or {})}
    check_tp_size(ModelArch.from_hf_config(hf_config), config.parallel.tensor_parallel_size)
    if config.offload.enabled:
        raise ValueError(
            "kv_offload is not supported with tensor_parallel_size > 1 (the tiers would hold rank 0's KV heads only)."
        )
    spec = config.speculative
    if spec is not None and spec.method in ("eagle", "eagle3"):
        raise ValueError(
            f"speculative_config.method {spec.method!r} is not supported with tensor_parallel_size > 1; "
            "use 'ngram' or 'draft_model'."
        )


def rank_devices(device: torch.device, tensor_parallel_size: int) -> list[torch.device]:
    """Rank r's device: the CPU, or GPU (index of `device`, default 0) + r on this machine."""
    if device.type != "cuda":
        return [torch.device("cpu")] * tensor_parallel_size
    base = device.index or 0
    if torch.cuda.device_count() < base + tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} needs GPUs {base}..."
            f"{base + tensor_parallel_size - 1}, but only {torch.cuda.device_count()} are visible."
        )
    return [torch.device("cuda", base + r) for r in range(tensor_parallel_size)]


def _adopt(config: EngineConfig, device: torch.device) -> tuple[TPGroup, torch.device]:
    """Rank 0 under torchrun (server/launch.py): the group exists, the other ranks wait in it."""
    tp = config.parallel.tensor_parallel_size
    if dist.get_world_size() != tp or dist.get_rank() != 0:
        raise ValueError(
            f"tensor_parallel_size {tp} must equal the launcher's world size "
            f"{dist.get_world_size()}, and the engine must run on rank 0."
        )
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return adopt_default_group(device), device


def build_tp_executor(config: EngineConfig, device: torch.device, dtype: torch.dtype, progress: bool) -> TPExecutor:
    """Validate, start ranks 1..N-1 (or adopt torchrun's group), build rank 0's shard."""
    del dtype  # every rank resolves it from the config, the same way
    check_tp_config(config)
    procs: WorkerProcs | None = None
    if dist.is_initialized():
        group, device0 = _adopt(config, device)
    else:
        devices = rank_devices(device, config.parallel.tensor_parallel_size)
        device0 = devices[0]
        if device0.type == "cuda":
            torch.cuda.set_device(device0)
        tp = config.parallel.tensor_parallel_size
        procs = WorkerProcs.start(config, devices, STEP_TIMEOUT_S, START_TIMEOUT_S)
        try:
            procs.wait_for_hello(START_TIMEOUT_S)
            group = init_tp_group(procs.store, 0, tp, device0, datetime.timedelta(seconds=STEP_TIMEOUT_S))
        except BaseException:
            procs.terminate()
            raise

    def make_runner(loaded, spec, num_blocks, dev, backend) -> TPExecutor:
        return TPExecutor(loaded, spec, num_blocks, dev, backend, group=group, procs=procs)

    try:
        return build_rank_runner(config, group, device0, progress, make_runner=make_runner)
    except BaseException as e:
        dead = procs.describe_dead() if procs is not None else ""
        if procs is not None:
            procs.terminate()
        release_tp_group(group)
        if dead:
            raise WorkerDiedError(f"tensor-parallel worker died while loading: {dead}") from e
        raise
