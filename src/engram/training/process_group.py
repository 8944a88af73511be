"""A training job's processes: joining the job torchrun describes, and spawning one on loopback.

Kept apart from the training loop (``distributed.py``) and its checkpoints (``dist_checkpoint.py``)
so both can name the job without importing each other.
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import UserError


class DistributedError(RuntimeError):
    pass


@dataclass
class Dist:
    """This process's place in the job and the groups it talks on."""
    rank: int
    world: int
    device: torch.device
    tables: Any  # group of the tables' all-to-alls; not DDP's, so the two never interleave
    control: Any  # gloo, also beside NCCL: barriers, bookkeeping (monitored_barrier is gloo-only)
    timeout_s: float
    owns_group: bool  # we initialised the default group, so we destroy it


def init_distributed(timeout_s: float = 300.0, backend: str | None = None) -> Dist:
    """Join the job torchrun (or ``spawn_local``) described in the environment (env://)."""
    owns = not dist.is_initialized()
    if owns:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if k not in os.environ]
        if missing:
            raise DistributedError(f"{', '.join(missing)} not set: launch with torchrun "
                                   "(torchrun --nproc-per-node N -m engram train ...)")
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # The timeout bounds the rendezvous and every collective: a dead or hung peer is an error.
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    to = timedelta(seconds=timeout_s)
    cuda = dist.get_backend() == "nccl"
    return Dist(dist.get_rank(), dist.get_world_size(),
                torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
                dist.new_group(backend=dist.get_backend(), timeout=to),
                dist.new_group(backend="gloo", timeout=to), timeout_s, owns)


def default_backend() -> str:
    """NCCL when each of this machine's ranks has a GPU of its own, else gloo: NCCL cannot share
    one GPU between ranks, and set_device(LOCAL_RANK) fails past the last GPU (a 3-process job on
    a 1-GPU machine, as the tests spawn)."""
    if not torch.cuda.is_available():
        return "gloo"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", int(os.environ.get("LOCAL_RANK", 0)) + 1))
    if torch.cuda.device_count() < local:
        warnings.warn(f"{local} ranks on this machine, {torch.cuda.device_count()} GPU(s): "
                      "joining over gloo on the CPU", RuntimeWarning, stacklevel=3)
        return "gloo"
    return "nccl"


def backend_for(device: str) -> str | None:
    """The process group's backend for a run's ``--device`` under torchrun (None: by the GPUs there
    are, ``default_backend``); a UserError, before the job starts, where it cannot be had."""
    if device == "cpu":
        return "gloo"
    if device == "auto":
        return None
    if ":" in device and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError(f"device {device!r}: under torchrun each rank takes its own GPU "
                        "(LOCAL_RANK); use --device cuda")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", int(os.environ.get("LOCAL_RANK", 0)) + 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < local:
        raise UserError(f"device {device!r}: {local} rank(s) on this machine need a GPU each, "
                        f"torch sees {gpus}; use --device cpu or auto")
    return "nccl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, fn: Callable, world: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    fn(*args)


def spawn_local(fn: Callable, world: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``world`` fresh processes on loopback, with torchrun's environment."""
    mp.start_processes(_spawned, args=(fn, world, free_port(), args), nprocs=world,
                       start_method="spawn")


def start_local(fn: Callable, world: int, *args: Any) -> list:
    """As ``spawn_local``, but return the started processes without waiting (a fault test
    kills one and watches the others)."""
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_spawned, args=(r, fn, world, port, args)) for r in range(world)]
    for p in procs:
        p.start()
    return procs
