"""Pipeline schedules as data: a static table of (tick, stage) -> (active, microbatch, repeat).

The layers are viewed as ``[repeats R, stages P, layers_per_stage]``. A microbatch passes
through stages ``0..P-1`` once per repeat (layer order is unchanged: repeat ``r`` of stage
``p`` holds layers ``(r P + p) k .. (r P + p + 1) k - 1``). Work item ``i = r M + m`` (repeat
``r`` of microbatch ``m``) is on stage ``p`` at tick ``i + p``, so the run takes
``M R + P - 1`` ticks. With ``R = 1`` this is GPipe; with ``R > 1`` it is the circular
(interleaved) schedule, whose bubble is ``R`` times smaller for the same number of layers.
A microbatch leaving the last stage re-enters stage 0 ``M - P + 1`` ticks later, so circular
schedules need ``M >= P`` (any ``M``, not only multiples of ``P``); GPipe takes any ``M``.

One executor (`eqxzoo.parallel.pipeline`) runs any table; a new schedule is a new table.
"""

import dataclasses
from typing import Literal

import numpy as np

from eqxzoo.errors import UserError
from eqxzoo.typed_config import check_fields

ScheduleName = Literal["gpipe", "circular"]


class ScheduleError(UserError, ValueError):
    """An impossible (schedule, stages, microbatches, repeats) combination."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: ScheduleName
    stages: int
    microbatches: int
    repeats: int

    def __post_init__(self):
        check_fields(self)
        if self.stages < 1 or self.microbatches < 1 or self.repeats < 1:
            raise ScheduleError(
                f"stages, microbatches and repeats must be >= 1, got "
                f"{self.stages}, {self.microbatches}, {self.repeats}"
            )
        if self.name == "gpipe" and self.repeats != 1:
            raise ScheduleError(
                f"the gpipe schedule has one repeat per stage, got repeats={self.repeats}: "
                "use schedule 'circular' for repeats > 1"
            )
        if self.name == "circular" and self.repeats > 1 and self.microbatches < self.stages:
            raise ScheduleError(
                f"the circular schedule needs microbatches >= stages, got "
                f"microbatches={self.microbatches} < stages={self.stages}"
            )

    @property
    def ticks(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        return (self.stages - 1) / self.ticks

    def table(self) -> dict[str, np.ndarray]:
        """``active``, ``microbatch`` and ``repeat``, each of shape ``(ticks, stages)``.

        Inactive (bubble) entries have microbatch and repeat 0; executors must skip them.
        """
        tick = np.arange(self.ticks)[:, None]
        stage = np.arange(self.stages)[None, :]
        item = tick - stage
        active = (item >= 0) & (item < self.microbatches * self.repeats)
        item = np.where(active, item, 0)
        return {
            "active": active,
            "microbatch": (item % self.microbatches).astype(np.int32),
            "repeat": (item // self.microbatches).astype(np.int32),
        }
