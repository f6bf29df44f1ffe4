"""The step's control vector (launch.step_control): pack/unpack round trip, each field's reduction over
ranks, the stop cause's precedence, and the one all-reduce and host read on a gloo world of one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launch.step_control import ANY, MAX, Save, StepControl, Stop, slot


def _reduced(controls: list[StepControl]) -> StepControl:
    """What the ranks agree on: their packs summed slot by slot, as the all-reduce does."""
    world = len(controls)
    packs = [c.pack(rank, world) for rank, c in enumerate(controls)]
    return StepControl.unpack([sum(column) for column in zip(*packs)], world)


def _busy() -> StepControl:
    return StepControl(Stop.SWITCH, True, True, Save.RESIZE, True, 4, 32, True, (123.0, 456.0))


@pytest.mark.parametrize("world", [1, 3])
def test_rank_zeros_control_comes_back_as_packed(world: int) -> None:
    for control in (StepControl(), _busy()):
        packed = control.pack(0, world)
        assert len(packed) == 8 + 2 * world  # with the step's 4 sums: today's 12 + 2 * world slots
        assert StepControl.unpack(packed, world) == control
    assert isinstance(StepControl.unpack(_busy().pack(0, 1), 1).stop, Stop)


def test_each_field_reduces_as_it_says() -> None:
    rank0 = StepControl(stop=Stop.COMMAND, eval=True, save=Save.PERIODIC, resize_mbs=2, resize_gbs=16, memory=(5, 1))
    other = StepControl(stop=Stop.MAX_TIME, eval=True, save=Save.RESIZE, resize_mbs=8, resize_gbs=64)
    other.signalled, other.writing, other.veto, other.memory = True, True, True, (9.0, 0.5)
    agreed = _reduced([rank0, other, StepControl(memory=(7.0, 3.0))])
    # rank 0's decisions, whatever the others packed; any rank's flags; the maximum of each memory slot
    assert (agreed.stop, agreed.eval, agreed.save, agreed.resize_mbs, agreed.resize_gbs) == (
        Stop.COMMAND, True, Save.PERIODIC, 2, 16,
    )  # fmt: skip
    assert (agreed.signalled, agreed.writing, agreed.veto) == (True, True, True)
    assert agreed.memory == (9.0, 3.0)
    assert _reduced([StepControl(), StepControl(), StepControl()]) == StepControl()


def test_the_stop_cause_puts_the_controllers_command_first() -> None:
    assert StepControl().cause is None
    assert StepControl(stop=Stop.SWITCH, signalled=True).cause == "command"
    assert StepControl(stop=Stop.COMMAND).cause == "command"
    assert StepControl(stop=Stop.MAX_TIME, signalled=True).cause == "signal"
    assert StepControl(stop=Stop.CONTROLLER_LOST).cause == "controller_lost"
    assert StepControl(stop=Stop.MAX_TIME).cause == "max_time"


def test_a_new_flag_is_a_field_and_nothing_else() -> None:
    @dataclass
    class WithFlag(StepControl):
        extra: bool = slot(False, ANY)
        peaks: tuple[float, ...] = slot((0.0,), MAX)

    packs = [WithFlag(extra=r == 1, peaks=(float(r),)).pack(r, 2) for r in range(2)]
    agreed = WithFlag.unpack([a + b for a, b in zip(*packs)], 2)
    assert agreed.extra and agreed.peaks == (1.0,) and agreed.stop == Stop.NONE


def test_one_all_reduce_and_one_host_read_on_a_world_of_one(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        reduced = _busy().all_reduce([torch.tensor(2.5, dtype=torch.float64), 3.0], torch.device("cpu"))
        assert reduced.shape == (2 + 8 + 2,) and reduced[0].item() == 2.5  # the sums stay on the device
        sums, agreed = StepControl.read(reduced, 2)
    finally:
        dist.destroy_process_group()
    assert sums == [2.5, 3.0] and agreed == _busy()
