"""`torchrun ... -m specserve.server.launch serve MODEL --tensor-parallel-size N`: rank 0 runs `serve`, whose
engine adopts the default process group; the others build their shard from the same flags and serve steps."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist


def _engine_config(argv: Sequence[str]):
    from specserve.config import EngineConfig
    from specserve.server import cli_args

    parser = argparse.ArgumentParser(prog="specserve serve")
    cli_args.add_engine_args(parser)
    cli_args.add_server_args(parser)
    return EngineConfig.from_kwargs(**cli_args.engine_kwargs(parser.parse_args(argv)))


def _run_worker(argv: Sequence[str], device: torch.device) -> int:
    from specserve.distributed.parallel_state import adopt_default_group
    from specserve.distributed.worker import build_rank_runner, release_cuda_graphs, serve_steps

    config = _engine_config(argv)
    if config.parallel.tensor_parallel_size != dist.get_world_size():
        raise SystemExit(
            f"--tensor-parallel-size {config.parallel.tensor_parallel_size} must equal "
            f"torchrun's world size {dist.get_world_size()}."
        )
    group = adopt_default_group(device)
    runner = build_rank_runner(config, group, device, progress=False)
    serve_steps(runner, group)
    release_cuda_graphs(runner)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        print("usage: torchrun ... -m specserve.server.launch serve [MODEL] [serve flags]", file=sys.stderr)
        return 2
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if rank == 0:
        from specserve.server.cli import main as cli_main

        return cli_main(argv)
    return _run_worker(argv[1:], device)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip process-group teardown: it can hang on NCCL (see parallel_state.release_tp_group)
