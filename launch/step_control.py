"""What the ranks agree on after each training step, carried by the step's one all-reduce.

Rank 0 decides stops, evaluations, checkpoints and resizes for every rank; every rank says whether a
SIGTERM reached it, whether its shards of a background checkpoint are still being written, whether it
vetoes FSDP's unsharded accumulation, and its peak memory. Each field of `StepControl` names how the
ranks' values combine: `RANK0` (rank 0's; the others send 0), `ANY` (true where any rank's is) or `MAX`
(each rank's numbers in slots of their own, the maximum over ranks read back). All of them ride one sum
all-reduce behind the step's own sums (loss, gradient norms) and come back in its one host read. A new
flag for the step is a new field here, nothing else.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

RANK0, ANY, MAX = "rank0", "any", "max"


class Stop(enum.IntEnum):
    """Rank 0's stop vote."""

    NONE = 0
    COMMAND = 1  # the controller's checkpoint_and_exit
    MAX_TIME = 2
    SWITCH = 3  # the controller's checkpoint_and_exit for a switch
    CONTROLLER_LOST = 4


class Save(enum.IntEnum):
    """Rank 0's checkpoint vote for after the step."""

    NONE = 0
    PERIODIC = 1  # time-based
    RESIZE = 2  # before a resize the controller asked a checkpoint for


def slot(default: Any, reduce: str) -> Any:
    """A `StepControl` field: its default (its type and, for `MAX`, its width) and how ranks combine it."""
    return field(default=default, metadata={"reduce": reduce})


@dataclass
class StepControl:
    """One rank's say in the step (`pack`) or, once reduced (`unpack`), what every rank agreed on."""

    stop: Stop = slot(Stop.NONE, RANK0)
    signalled: bool = slot(False, ANY)  # a SIGTERM reached the rank
    eval: bool = slot(False, RANK0)  # an evaluation after the step
    save: Save = slot(Save.NONE, RANK0)
    writing: bool = slot(False, ANY)  # the rank's shards of the background checkpoint are not all written
    resize_mbs: int = slot(0, RANK0)  # the controller's resize, taken after the step (0: none)
    resize_gbs: int = slot(0, RANK0)
    veto: bool = slot(False, ANY)  # no room for FSDP's unsharded gradients
    memory: tuple[float, ...] = slot((0.0, 0.0), MAX)  # peak memory (`launch.device.peak_memory`)

    def pack(self, rank: int, world: int) -> list[float]:
        """This rank's slots in the step's all-reduce."""
        out: list[float] = []
        for f in fields(self):
            value, reduce = getattr(self, f.name), f.metadata["reduce"]
            if reduce == MAX:
                width = len(f.default)
                out += [0.0] * (rank * width) + [float(v) for v in value] + [0.0] * ((world - rank - 1) * width)
            else:
                out.append(float(value) if reduce == ANY or rank == 0 else 0.0)
        return out

    @classmethod
    def unpack(cls, sums: Sequence[float], world: int) -> StepControl:
        """The agreed control from the slots summed over `world` ranks."""
        values: dict[str, Any] = {}
        i = 0
        for f in fields(cls):
            if f.metadata["reduce"] == MAX:
                width = len(f.default)
                slots = sums[i : i + width * world]
                values[f.name] = tuple(max(slots[j::width]) for j in range(width))
                i += width * world
            else:
                values[f.name] = _typed(type(f.default), sums[i])
                i += 1
        return cls(**values)

    def all_reduce(self, sums: Sequence[torch.Tensor | float], device: torch.device) -> torch.Tensor:
        """The step's one all-reduce: `sums` (0-d device tensors or numbers, summed over ranks) followed by
        this rank's control; stays on the device until `read`."""
        return sum_over_ranks([*sums, *self.pack(dist.get_rank(), dist.get_world_size())], device)

    @classmethod
    def read(cls, reduced: torch.Tensor, n_sums: int) -> tuple[list[float], StepControl]:
        """The step's one host read of `all_reduce`'s result: the `n_sums` sums and the agreed control."""
        values = reduced.tolist()
        return values[:n_sums], cls.unpack(values[n_sums:], dist.get_world_size())

    @property
    def cause(self) -> str | None:
        """Why the job stops after the step: the controller's command first (it asked for the stop), then
        a SIGTERM on any rank, a lost controller, max_time; None: it goes on."""
        if self.stop in (Stop.COMMAND, Stop.SWITCH):
            return "command"
        if self.signalled:
            return "signal"
        return {Stop.CONTROLLER_LOST: "controller_lost", Stop.MAX_TIME: "max_time"}.get(self.stop)


def _typed(kind: type, value: float) -> Any:
    if kind is bool:
        return value > 0
    if issubclass(kind, int):  # int and the enums
        return kind(round(value))
    return value


def sum_over_ranks(values: Sequence[torch.Tensor | float], device: torch.device) -> torch.Tensor:
    """Sum a few scalars (host numbers or 0-d device tensors) over all ranks with one all-reduce on
    `device`; the sums stay there until read."""
    t = torch.tensor([0.0 if isinstance(v, torch.Tensor) else v for v in values], dtype=torch.float64)
    t = t.to(device)  # one host-to-device copy for the host numbers
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            t[i] = v
    dist.all_reduce(t)
    return t
