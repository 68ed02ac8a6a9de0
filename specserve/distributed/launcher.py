"""Start the ranks > 0 of a tensor-parallel engine as fresh interpreters (no re-import of the user's
`__main__`), with the rendezvous store on rank 0, and watch them (`poll()`)."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from specserve.config import EngineConfig
from specserve.distributed.worker import _BOOTSTRAP, WorkerArgs, hello_key


class WorkerProcs:
    """The child processes of ranks 1..world_size-1 and the rendezvous store they joined."""

    def __init__(self, store: dist.TCPStore, procs: dict[int, subprocess.Popen]) -> None:
        self.store = store
        self.procs = procs

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        world_size: int,
        devices: list[torch.device],
        step_timeout_s: float,
        start_timeout_s: float,
    ) -> WorkerProcs:
        """devices[r]: rank r's device. Returns once the processes run (not yet joined)."""
        timeout = datetime.timedelta(seconds=start_timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
        threads = max(1, (os.cpu_count() or 1) // world_size)
        rest = (step_timeout_s, start_timeout_s, threads, os.getpid())
        procs: dict[int, subprocess.Popen] = {}
        try:
            for rank in range(1, world_size):
                args = WorkerArgs(config, rank, world_size, "127.0.0.1", store.port, str(devices[rank]), *rest)
                # A session of its own: Ctrl-C reaches rank 0 only, which drains, then stops the workers.
                proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path)],
                    stdin=subprocess.PIPE,
                    start_new_session=True,
                )
                procs[rank] = proc
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
        keys = [hello_key(rank) for rank in self.procs]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if self.dead():
                raise RuntimeError(
                    f"tensor-parallel worker failed to start: {self.describe_dead()}; see its error above."
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {timeout_s:.0f} s.")
            time.sleep(0.02)

    def wait(self, timeout_s: float) -> bool:
        """True when every child exited within the timeout."""
        deadline = time.monotonic() + timeout_s
        while len(self.dead()) < len(self.procs):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def wait_any_dead(self, timeout_s: float) -> bool:
        """True as soon as some child has exited; False if none did within the timeout."""
        deadline = time.monotonic() + timeout_s
        while not self.dead():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

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
