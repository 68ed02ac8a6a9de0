"""The rank side of tensor parallelism: every rank runs `build_rank_runner` (load, shard, profile, agree on
KV blocks, capture graphs) in the same order, so collectives pair up; ranks > 0 then run `serve_steps`."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specserve.config import EngineConfig
from specserve.distributed.parallel_state import TPGroup, init_tp_group
from specserve.distributed.tp import shard_model
from specserve.model.loader import LoadedModel, resolve_dtype
from specserve.runner.batch import HostBatch
from specserve.runner.build import build_runner
from specserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

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
    store_host: str
    store_port: int
    device: str  # "cpu" or "cuda:N"
    step_timeout_s: float
    start_timeout_s: float
    num_threads: int
    parent_pid: int


def hello_key(rank: int) -> str:
    return f"specserve/tp/hello/{rank}"


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
    store = dist.TCPStore(args.store_host, args.store_port, args.world_size, is_master=False, timeout=timeout)
    store.set(hello_key(args.rank), "up")
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
