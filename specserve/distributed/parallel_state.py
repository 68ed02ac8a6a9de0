"""Process groups for tensor parallelism over the same ranks: `device_group` (the model's collectives; NCCL
on GPUs, gloo on the CPU; its timeout bounds one step) and `cpu_group` (gloo: control messages and
start-up agreements; long timeout, a dead peer still fails a pending send at once)."""

from __future__ import annotations

import datetime
import pickle
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Long enough for any idle period of a server; dead peers are detected by closed sockets, not this.
IDLE_TIMEOUT = datetime.timedelta(days=30)
# Control messages travel in one fixed-size broadcast; a larger one sends its remainder in a second.
_CONTROL_HEAD_BYTES = 1 << 14


@dataclass
class TPGroup:
    """This process's view of the tensor-parallel group."""

    rank: int
    world_size: int
    backend: str  # "nccl" | "gloo": the device group's backend
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    owns_default_group: bool = True  # False when adopted from a launcher (torchrun)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [*shape] from every rank -> [world_size, *shape], rank order."""
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        if self.backend == "nccl":
            dist.all_gather_into_tensor(out, x, group=self.device_group)
        else:  # gloo has no all_gather_into_tensor on every torch version
            dist.all_gather(list(out.unbind(0)), x, group=self.device_group)
        return out

    def broadcast_object(self, obj: object | None) -> object:
        """Rank 0 sends `obj` (picklable); every other rank passes None and gets it back."""
        head = torch.zeros(_CONTROL_HEAD_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            n = len(payload)
            head[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            first = min(n, _CONTROL_HEAD_BYTES - 8)
            head[8 : 8 + first] = torch.frombuffer(bytearray(payload[:first]), dtype=torch.uint8)
        dist.broadcast(head, src=0, group=self.cpu_group)
        n = int(head[:8].view(torch.int64).item())
        first = min(n, _CONTROL_HEAD_BYTES - 8)
        if n > first:  # the rest of a large message
            rest = torch.empty(n - first, dtype=torch.uint8)
            if self.rank == 0:
                rest.copy_(torch.frombuffer(bytearray(payload[first:]), dtype=torch.uint8))
            dist.broadcast(rest, src=0, group=self.cpu_group)
            data = head[8 : 8 + first].numpy().tobytes() + rest.numpy().tobytes()
        else:
            data = head[8 : 8 + first].numpy().tobytes()
        return obj if self.rank == 0 else pickle.loads(data)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks: each rank must get the same count)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)


def init_tp_group(
    store: dist.Store, rank: int, world_size: int, device: torch.device, step_timeout: datetime.timedelta
) -> TPGroup:
    """Join the group whose rendezvous is `store` (rank 0 hosts it; see executor.py)."""
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process: close the "
            "other tensor-parallel engine first (llm.engine.runner.close())."
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=step_timeout, **kw)
    return adopt_default_group(device, owns_default_group=True)


def adopt_default_group(device: torch.device, owns_default_group: bool = False) -> TPGroup:
    """A TPGroup over the default process group (ours, or a launcher's: torchrun + init_process_group)."""
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    world = dist.get_world_size()
    group = TPGroup(dist.get_rank(), world, dist.get_backend(), dist.group.WORLD, cpu_group, owns_default_group)
    # One collective now: NCCL builds its communicator on the first, which must not be in a graph capture.
    group.barrier()
    x = torch.ones(1, device=device)
    group.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if int(x.item()) != group.world_size:
        raise RuntimeError(f"tensor-parallel all-reduce self-check failed: {x.item()} != {group.world_size}")
    return group


def release_tp_group(group: TPGroup, timeout_s: float = 10.0) -> None:
    """Drop the groups without waiting on any other rank, within `timeout_s`. NCCL: abort, never destroy
    (ncclCommDestroy can hang once graphs captured collectives, pytorch#115388)."""
    if not group.owns_default_group or not dist.is_initialized():
        return

    def release() -> None:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        try:
            if group.backend == "nccl" and abort is not None:
                abort()  # every group of this process, the gloo control group included
            else:
                dist.destroy_process_group()
        except Exception:
            pass

    thread = threading.Thread(target=release, name="specserve-tp-release", daemon=True)
    thread.start()
    thread.join(timeout_s)
