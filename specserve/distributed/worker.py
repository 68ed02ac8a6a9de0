"""The rank side of tensor parallelism: every rank runs `build_rank_runner` (load, shard, profile, agree on
KV blocks, capture graphs) in the same order, so collectives pair up; ranks > 0 then run `serve_steps`.
`WorkerProcs` starts them as fresh interpreters (no re-import of the user's `__main__`) and watches them."""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specserve.config import EngineConfig
from specserve.distributed.parallel_layers import shard_model
from specserve.distributed.parallel_state import TPGroup, init_tp_group
from specserve.model.loader import LoadedModel, resolve_dtype
from specserve.runner.batch import HostBatch
from specserve.runner.build import build_runner
from specserve.runner.model_runner import ModelRunner

_BOOTSTRAP = (
    "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); from specserve.distributed.worker import main; main()"
)


@dataclass
class StepMessage:
    host: HostBatch
    need_hidden: bool


@dataclass
class Shutdown:
    pass


@dataclass
class WorkerArgs:
    config: EngineConfig
    rank: int
    world_size: int
    store_port: int  # of rank 0's store on 127.0.0.1
    device: str  # "cpu" or "cuda:N"
    step_timeout_s: float
    start_timeout_s: float
    num_threads: int
    parent_pid: int


def build_rank_runner(
    config: EngineConfig,
    group: TPGroup,
    device: torch.device,
    progress: bool,
    make_runner: Callable[..., ModelRunner] = ModelRunner,
) -> ModelRunner:
    """Load, shard, size the KV pool and capture graphs: the same collectives on every rank."""
    dtype = resolve_dtype(config.model.dtype, device)
    # Dummy weights come from this seed: every rank builds the same full model, then slices it.
    torch.manual_seed(config.model.seed)

    def shard(loaded: LoadedModel) -> int:
        # A rank that failed to load shows up here, on gloo (a closed socket), not in an NCCL hang.
        group.barrier()
        shard_model(loaded.model, group.rank, group.world_size, group)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the full weights are gone; the profile must not count them
        return loaded.arch.num_kv_heads // group.world_size

    return build_runner(config, device, dtype, progress, shard=shard, agree=group.min_int, make_runner=make_runner)


def release_cuda_graphs(runner: ModelRunner) -> None:
    """Free the runner's CUDA graphs, before the communicator (pytorch#115388); it runs eagerly afterwards."""
    graphs, runner.graphs = runner.graphs, None
    if graphs is None:
        return
    torch.cuda.synchronize(runner.device)
    for graph in graphs.graphs.values():
        graph.reset()
    graphs.graphs.clear()
    graphs.outputs.clear()


def serve_steps(runner: ModelRunner, group: TPGroup) -> None:
    """Ranks > 0: run every step rank 0 broadcasts, until Shutdown. No sync per step: rank 0 sends the next
    message only after this step's logits all-gather, which follows this rank's input copies."""
    while True:
        msg = group.broadcast_object(None)
        if isinstance(msg, Shutdown):
            return
        if not isinstance(msg, StepMessage):
            raise RuntimeError(f"tensor-parallel worker got an unknown message {type(msg).__name__}")
        runner.execute_host(msg.host, msg.need_hidden)


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (reparented), even if no collective is pending."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, name="specserve-tp-parent-watch", daemon=True).start()


def run_worker(args: WorkerArgs) -> int:
    """A spawned rank: join the group, build, serve steps. Exit code 0 after a Shutdown."""
    _watch_parent(args.parent_pid)
    torch.set_num_threads(args.num_threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.start_timeout_s)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size, is_master=False, timeout=timeout)
    store.set(f"specserve/tp/hello/{args.rank}", "up")
    group = init_tp_group(store, args.rank, args.world_size, device, datetime.timedelta(seconds=args.step_timeout_s))
    runner = build_rank_runner(args.config, group, device, progress=False)
    serve_steps(runner, group)
    # No process-group teardown: main() leaves with os._exit, which frees the sockets and the
    # communicator without waiting on any other rank.
    release_cuda_graphs(runner)
    return 0


def main() -> None:
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s tp-rank{args.rank}: %(message)s")
    try:
        code = run_worker(args)
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):
            print(f"specserve tensor-parallel rank {args.rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass(eq=False)
class WorkerProcs:
    """The child processes of ranks 1..world_size-1 and the rendezvous store they joined."""

    store: dist.TCPStore
    procs: dict[int, subprocess.Popen]

    @classmethod
    def start(cls, config: EngineConfig, devices: list[torch.device], step_s: float, start_s: float) -> WorkerProcs:
        """devices[r]: rank r's device (world size: their number). Returns once the processes run (not joined)."""
        world_size, timeout = len(devices), datetime.timedelta(seconds=start_s)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
        threads = max(1, (os.cpu_count() or 1) // world_size)
        rest = (step_s, start_s, threads, os.getpid())
        procs: dict[int, subprocess.Popen] = {}
        cmd = [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path)]
        try:
            for rank in range(1, world_size):
                args = WorkerArgs(config, rank, world_size, store.port, str(devices[rank]), *rest)
                # A session of its own: Ctrl-C reaches rank 0 only, which drains, then stops the workers.
                procs[rank] = proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)
                proc.stdin.write(pickle.dumps(args))
                proc.stdin.close()
        except BaseException:
            cls(store, procs).terminate()
            raise
        return cls(store, procs)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.procs.items()}

    def dead(self) -> dict[int, int]:
        """rank -> exit code of every child that has exited."""
        return {rank: code for rank, p in self.procs.items() if (code := p.poll()) is not None}

    def describe_dead(self) -> str:
        return ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(self.dead().items()))

    def wait_for_hello(self, timeout_s: float) -> None:
        """Block until every worker reached the store; RuntimeError at once if one exits first."""
        keys = [f"specserve/tp/hello/{rank}" for rank in self.procs]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if dead := self.describe_dead():
                raise RuntimeError(f"tensor-parallel worker failed to start: {dead}; see its error above.")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {timeout_s:.0f} s.")
            time.sleep(0.02)

    @staticmethod
    def _until(done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def wait(self, timeout_s: float) -> bool:
        """True when every child exited within the timeout."""
        return self._until(lambda: len(self.dead()) == len(self.procs), timeout_s)

    def wait_any_dead(self, timeout_s: float) -> bool:
        """True as soon as some child has exited; False if none did within the timeout."""
        return self._until(lambda: bool(self.dead()), timeout_s)

    def terminate(self, grace_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`: no child outlives the engine."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        if not self.wait(grace_s):
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
            self.wait(grace_s)
