"""Where a model runs and in what precision: device names, autocast, table dtypes, the loss scale.

``--device``: ``cpu``, ``cuda`` (this process's GPU; under torchrun each rank's own), ``cuda:N``,
or ``auto`` (CUDA when torch sees a GPU, else the CPU). ``--precision``:

- ``fp32``: everything float32, no autocast (the default; bit-identical to runs before these
  options existed).
- ``bf16`` / ``fp16``: the dense model computes under ``torch.autocast`` (its weights and AdamW's
  state stay float32: autocast casts the weights per product); the Engram tables are *stored* in
  that dtype (half the memory of the largest parameters), RowAdam's moments stay float32 and the
  update is made in float32, then rounded once into the row. The numerically fragile parts run in
  float32 inside the autocast region: the Engram gate and short conv (norms, sigmoid, SiLU;
  module/engram.py), the adaptive-softmax head and every loss (models/). fp16's narrow range
  needs the loss scaled (``LossScaler``); bf16 has float32's range and needs none.

Errors are the user's (``engram.errors.UserError``) and come before any work: an unknown
name, ``cuda`` without a GPU, a precision the device's autocast does not support, ``--compile``
where torch.compile cannot build code (no C++ compiler for the CPU, no Triton for CUDA).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..tables.sharded import ShardedTable
from ..tables.store import MemoryTable

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE_HELP = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_names(device: str, precision: str) -> None:
    """The spelling of a device and a precision (no hardware consulted: configs call this)."""
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise UserError(f"device must be {DEVICE_HELP}, got {device!r}")
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def resolve_device(name: str) -> torch.device:
    """The device a name stands for on this machine; UserError when it is not there."""
    check_names(name, "fp32")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"device {name!r}: torch sees no CUDA device here (torch "
                        f"{torch.__version__}, built for CUDA {torch.version.cuda}); use --device "
                        "cpu or auto")
    index = int(name.split(":")[1]) if ":" in name else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise UserError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA "
                        f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether autocast on ``device_type`` computes a product in ``dtype`` (a torch without it
    warns and runs float32, which would make a bf16/fp16 run an fp32 one in disguise)."""
    if dtype == torch.float32:
        return True
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return False
    x = torch.ones(2, 2, device=device_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autocast(device_type, dtype=dtype):
                return F.linear(x, x).dtype == dtype
        except RuntimeError:
            return False


def check_precision(precision: str, device: torch.device) -> None:
    """UserError unless ``precision`` runs on ``device``."""
    check_names("cpu", precision)
    if not autocast_supported(device.type, DTYPES[precision]):
        raise UserError(f"precision {precision!r} is not supported on {device} by torch "
                        f"{torch.__version__} (its autocast cannot compute in "
                        f"{DTYPES[precision]}); use --precision fp32"
                        + ("" if precision == "bf16" else " or bf16"))


def check_compile(device: torch.device) -> None:
    """UserError unless ``torch.compile`` can build code for ``device`` here: TorchDynamo on this
    Python, a C++ compiler for the CPU (inductor's: ``$CXX``, else g++), Triton for CUDA. Checked
    up front because otherwise the first training step fails after the data and model are built."""
    import torch._dynamo  # only when compiling: the import takes a second

    if not torch._dynamo.is_dynamo_supported():
        raise UserError(f"--compile: torch {torch.__version__} cannot compile on Python "
                        f"{sys.version.split()[0]}; leave --compile off")
    if device.type == "cpu":
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            raise UserError(f"--compile on the CPU needs a C++ compiler; {cxx!r} (from $CXX, "
                            "else g++) is not on PATH; install one or leave --compile off")
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise UserError(f"--compile on {device} needs Triton, which this torch "
                            f"({torch.__version__}) cannot import; install triton or leave "
                            "--compile off")


def resolve(device: str, precision: str, compile: bool = False) -> torch.device:
    """Every check at a job's start, before any work: the device, the precision on it, and
    whether it can compile (when asked)."""
    dev = resolve_device(device)
    check_precision(precision, dev)
    if compile:
        check_compile(dev)
    return dev


def autocast(precision: str, device: torch.device | str) -> AbstractContextManager:
    """The autocast region of a forward: none for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[precision])


def cast_tables(model: nn.Module, precision: str) -> nn.Module:
    """Store every in-memory table of ``model`` (MemoryTable, ShardedTable) in the precision's
    dtype, in place; fp32 leaves them as they are."""
    if precision != "fp32":
        for m in model.modules():
            if isinstance(m, (MemoryTable, ShardedTable)):
                m.to(DTYPES[precision])
    return model


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class LossScaler:
    """Dynamic loss scaling for fp16 (as torch.amp.GradScaler: start at 2^16, halve on a
    non-finite gradient and skip that step, double after ``growth_interval`` finite ones).

    Our own rather than GradScaler's because (1) the tables are fp16 and GradScaler refuses to
    unscale fp16 gradients, (2) their gradients are sparse, and (3) under torchrun each rank holds
    different table rows, so whether a step is skipped must be agreed over the ranks (``sum_ranks``)
    or the ranks' replicas would part. The scale is a power of two, so unscaling is exact except
    where a value falls below fp16's normal range.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale, self.good_steps = init_scale, 0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @property
    def may_overflow(self) -> bool:
        """Whether a non-finite gradient may be the scale's own doing (a scale above 1 enlarges
        the gradients); at 1 or below it is the run's (training.loop raises NonFinite)."""
        return self.scale > 1.0

    def unscale_(self, params: Iterable[torch.Tensor],
                 sum_ranks: Callable[[list[float]], list[float]] | None = None) -> bool:
        """Divide every gradient by the scale, in place; whether all are finite (on every rank)."""
        inv, flags = 1.0 / self.scale, []
        for p in params:
            g = p.grad
            if g is None:
                continue
            v = g._values() if g.is_sparse else g  # uncoalesced values: the same check and scale
            v.mul_(inv)
            flags.append(torch.isfinite(v).all().logical_not())
        bad = float(torch.stack(flags).any()) if flags else 0.0
        if sum_ranks is not None:
            bad = sum_ranks([bad])[0]
        return bad == 0

    def update(self, finite: bool) -> None:
        """After the step (done or skipped): back off on a non-finite gradient, else grow now and
        then."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": float(self.scale), "good_steps": int(self.good_steps)}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps = float(sd["scale"]), int(sd["good_steps"])
