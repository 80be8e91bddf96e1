"""Pipeline schedules as data: static tables of (tick, stage) -> what the stage does.

The layers are viewed as ``[repeats R, stages P, layers_per_stage]``. A microbatch passes
through stages ``0..P-1`` once per repeat (layer order is unchanged: repeat ``r`` of stage
``p`` holds layers ``(r P + p) k .. (r P + p + 1) k - 1``): its *virtual stage* ``v = r P + p``
is one chunk of ``k`` layers. Every stage acts in lockstep, one action per tick.

Forward schedules, differentiated by autodiff (`eqxzoo.parallel.pipeline`):

- ``gpipe`` (``R = 1``) and ``circular`` (``R > 1``): work item ``i = r M + m`` is on stage
  ``p`` at tick ``i + p``, so the forward takes ``M R + P - 1`` ticks. A microbatch leaving the
  last stage re-enters stage 0 ``M - P + 1`` ticks later, so circular needs ``M >= P``.
  Autodiff keeps every microbatch's stage inputs for the backward: memory grows with ``M``.

Forward-and-backward schedules, run by one executor that takes ``jax.vjp`` of the stage
inside the scan (`eqxzoo.parallel.pipeline_grad`); actions are F (forward), B (input
gradient), W (weight gradient) and BW (both at once):

- ``1f1b``: stage ``p`` runs ``P - 1 - p`` forwards, then alternates one F and one BW, then
  drains its BWs. At most ``P - p`` microbatches are in flight on stage ``p``.
- ``interleaved_1f1b`` (``R > 1``, Megatron's order): forwards go through the chunks in
  groups of ``P`` microbatches, repeat by repeat; ``2 (P - 1 - p) + (R - 1) P`` warm-up
  forwards, then one F, one BW. The bubble is ``R`` times smaller; the stash holds at most
  ``(R - 1) P + 2 (P - 1 - p) + 1`` chunks (each ``1/R`` of a stage) on stage ``p``.
- ``zb_h1`` (zero bubble, Qi et al. 2023, "H1": 1F1B's memory): 1F1B with every BW split into
  B and W, stage ``p`` deferring its Ws by ``p`` microbatches, so the last stages fill the
  drain with weight gradients. In flight: at most ``P`` microbatches.

Each table is built by running every stage's ordered list of actions in lockstep (an action
runs at the first tick its inputs exist: an F after the previous chunk's F, a B after the
next chunk's B and its own F, a W after its B), which checks the dependencies; stash slots
(one per item in flight on a stage, from the arrival of its input to its last backward
action) are assigned as it runs. `Schedule.modelled_time` prices a table with the lockstep
model: a tick costs its slowest stage's action (F = 1, B = W = 1, BW = 2, per chunk scaled by
``1/R``), because simulated CPU devices cannot show idle time.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import numpy as np

from eqxzoo.errors import UserError
from eqxzoo.typed_config import check_fields

ScheduleName = Literal["gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1"]

IDLE, F, B, W, BW = 0, 1, 2, 3, 4
ACTION_NAMES = {IDLE: "idle", F: "F", B: "B", W: "W", BW: "BW"}


class ScheduleError(UserError, ValueError):
    """An impossible (schedule, stages, microbatches, repeats) combination."""


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of one stage's action on a whole stage's layers, in units of a forward."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0


@dataclasses.dataclass(frozen=True)
class ActionTable:
    """A forward-and-backward schedule, each array ``(ticks, stages)``.

    ``action`` (IDLE, F, B, W, BW), ``microbatch`` and ``repeat`` of the item acted on,
    ``slot``: its stash slot; ``arrive_input`` / ``arrive_grad``: the slot where the
    activation (cotangent) that the previous (next) stage sent at the tick before lands, or
    -1. ``slots`` is the stash size (the most items in flight on a stage).
    """

    action: np.ndarray
    microbatch: np.ndarray
    repeat: np.ndarray
    slot: np.ndarray
    arrive_input: np.ndarray
    arrive_grad: np.ndarray
    slots: int

    @property
    def ticks(self) -> int:
        return self.action.shape[0]


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
        self.spec.check(self)

    @property
    def spec(self) -> "ScheduleSpec":
        return SCHEDULES[self.name]

    @property
    def fuses_backward(self) -> bool:
        """Whether the schedule runs the backward itself (the 1F1B family)."""
        return self.spec.fuses_backward

    @property
    def forward_only(self) -> "Schedule":
        """The forward schedule over the same stages, microbatches and repeats (``gpipe`` or
        ``circular``): what evaluation, which needs no backward, runs."""
        if not self.fuses_backward:
            return self
        name = "circular" if self.repeats > 1 else "gpipe"
        return Schedule(name, self.stages, self.microbatches, self.repeats)

    @property
    def ticks(self) -> int:
        """Ticks of the forward table (forward schedules) or of the action table."""
        if self.fuses_backward:
            return self.actions().ticks
        return self.microbatches * self.repeats + self.stages - 1

    def table(self) -> dict[str, np.ndarray]:
        """The forward table of ``gpipe``/``circular``: ``active``, ``microbatch`` and
        ``repeat``, each of shape ``(ticks, stages)``: the forward half of the action table
        its stage orders give (item ``r M + m`` on stage ``p`` at tick ``r M + m + p``).

        Inactive (bubble) entries have microbatch and repeat 0; executors must skip them.
        """
        assert not self.fuses_backward, self.name
        forward = slice(0, self.ticks)
        actions = self.actions()
        active = actions.action[forward] == F
        return {
            "active": active,
            "microbatch": np.where(active, actions.microbatch[forward], 0),
            "repeat": np.where(active, actions.repeat[forward], 0),
        }

    def actions(self) -> ActionTable:
        """The forward-and-backward table: built for the 1F1B family, and for GPipe and
        circular their forward table followed by its mirror image (autodiff's backward)."""
        return _action_table(self)

    def modelled_time(self, costs: Costs = Costs()) -> float:
        """The step's time in the lockstep model: the sum over ticks of the slowest stage's
        action, each action on a chunk costing ``1/R`` of it on a whole stage."""
        table = self.actions()
        price = np.zeros(5)
        price[F] = costs.forward
        price[B] = costs.input_grad
        price[W] = costs.weight_grad
        price[BW] = costs.input_grad + costs.weight_grad
        return float(price[table.action].max(axis=1).sum() / self.repeats)

    def bubble_fraction(self, costs: Costs = Costs()) -> float:
        """The idle share of the modelled step: ``1 - useful / modelled_time``."""
        useful = self.microbatches * (costs.forward + costs.input_grad + costs.weight_grad)
        return 1.0 - useful / self.modelled_time(costs)

    def in_flight(self) -> int:
        """The most microbatch chunks a stage keeps at once (its stash, in chunks of ``1/R``
        of a stage); forward schedules keep every one until the backward."""
        return self.actions().slots


def stage_orders(schedule: Schedule) -> list[list[tuple[int, int, int]]]:
    """Each stage's actions ``(kind, microbatch, repeat)`` in the order it runs them."""
    P, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    return [schedule.spec.stage_order(P, M, R, stage) for stage in range(P)]


Action = tuple[int, int, int]  # (kind, microbatch, repeat)


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its ``name``; whether the 1F1B-family executor runs it
    (``fuses_backward``; else its forward table is differentiated by autodiff); ``check``,
    which refuses the (stages, microbatches, repeats) it cannot run with a `ScheduleError`;
    and ``stage_order(P, M, R, stage)``, the stage's actions in the order it runs them, from
    which the action table (and a forward schedule's forward table) is built."""

    name: str
    fuses_backward: bool
    check: Callable[[Schedule], None]
    stage_order: Callable[[int, int, int, int], list[Action]]


def _one_repeat(schedule: Schedule) -> None:
    if schedule.repeats != 1:
        other = "circular" if schedule.name == "gpipe" else "interleaved_1f1b"
        raise ScheduleError(
            f"the {schedule.name} schedule has one repeat per stage, got "
            f"repeats={schedule.repeats}: use schedule '{other}' for repeats > 1",
            field="repeats",
        )


def _microbatches_cover_stages(schedule: Schedule) -> None:
    if schedule.microbatches < schedule.stages:
        raise ScheduleError(
            f"the {schedule.name} schedule needs microbatches >= stages, got "
            f"microbatches={schedule.microbatches} < stages={schedule.stages}",
            field="microbatches",
        )


def _check_circular(schedule: Schedule) -> None:
    if schedule.repeats > 1:
        _microbatches_cover_stages(schedule)


def _check_interleaved(schedule: Schedule) -> None:
    if schedule.repeats == 1:
        raise ScheduleError(
            "the interleaved_1f1b schedule interleaves repeats > 1 over the stages, got "
            "repeats=1: use schedule '1f1b' for one repeat",
            field="repeats",
        )
    _microbatches_cover_stages(schedule)


def _forward_then_backward(P: int, M: int, R: int, stage: int) -> list[Action]:
    """GPipe and circular: every forward, then autodiff's mirror image of them."""
    forward = [(F, m, r) for r in range(R) for m in range(M)]
    backward = [(BW, m, r) for r in reversed(range(R)) for m in reversed(range(M))]
    return forward + backward


def _alternate(forward: list[Action], backward: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward at a time, then the rest."""
    order = forward[:warmup]
    for index, item in enumerate(backward):
        if warmup + index < len(forward):
            order.append(forward[warmup + index])
        order.append(item)
    return order


def _one_f_one_b(P: int, M: int, R: int, stage: int) -> list[Action]:
    forward = [(F, m, 0) for m in range(M)]
    backward = [(BW, m, 0) for m in range(M)]
    return _alternate(forward, backward, warmup=min(P - 1 - stage, M))


def _interleaved_one_f_one_b(P: int, M: int, R: int, stage: int) -> list[Action]:
    """Megatron's order: forwards through the chunks in groups of ``P`` microbatches."""
    groups = [range(start, min(start + P, M)) for start in range(0, M, P)]
    forward = [(F, m, r) for group in groups for r in range(R) for m in group]
    backward = [(BW, m, r) for group in groups for r in reversed(range(R)) for m in group]
    return _alternate(forward, backward, warmup=min(2 * (P - 1 - stage) + (R - 1) * P, M * R))


def _zero_bubble_h1(P: int, M: int, R: int, stage: int) -> list[Action]:
    return _split_and_defer_weight_grads(_one_f_one_b(P, M, R, stage), delay=stage)


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", False, _one_repeat, _forward_then_backward),
        ScheduleSpec("circular", False, _check_circular, _forward_then_backward),
        ScheduleSpec("1f1b", True, _one_repeat, _one_f_one_b),
        ScheduleSpec("interleaved_1f1b", True, _check_interleaved, _interleaved_one_f_one_b),
        ScheduleSpec("zb_h1", True, _one_repeat, _zero_bubble_h1),
    )
}


def _split_and_defer_weight_grads(order, delay: int):
    """Every BW as B then W, each W moved ``delay`` Bs later (the rest at the end)."""
    split, pending = [], []
    for kind, m, r in order:
        if kind != BW:
            split.append((kind, m, r))
            continue
        split.append((B, m, r))
        pending.append((W, m, r))
        if len(pending) > delay:
            split.append(pending.pop(0))
    return split + pending


@functools.lru_cache(maxsize=256)
def _action_table(schedule: Schedule) -> ActionTable:
    P, R = schedule.stages, schedule.repeats
    V = P * R
    orders = stage_orders(schedule)
    done: dict[tuple[int, int, int], int] = {}  # (kind, m, virtual stage) -> tick
    position = [0] * P
    rows: list[list[tuple[int, int, int]]] = []

    def ready(kind: int, m: int, r: int, stage: int, tick: int) -> bool:
        v = r * P + stage
        if kind == F:
            return v == 0 or done.get((F, m, v - 1), tick) < tick
        if kind in (B, BW):
            after_forward = done.get((F, m, v), tick) < tick
            if v == V - 1:
                return after_forward
            upstream = done.get((B, m, v + 1), done.get((BW, m, v + 1), tick))
            return after_forward and upstream < tick
        return done.get((B, m, v), tick) < tick  # W

    tick = 0
    while any(position[stage] < len(orders[stage]) for stage in range(P)):
        row = []
        for stage in range(P):
            if position[stage] < len(orders[stage]):
                kind, m, r = orders[stage][position[stage]]
                if ready(kind, m, r, stage, tick):
                    row.append((kind, m, r))
                    continue
            row.append((IDLE, 0, 0))
        if all(kind == IDLE for kind, _, _ in row):
            raise AssertionError(f"{schedule}: the stage orders deadlock at tick {tick}")
        for stage, (kind, m, r) in enumerate(row):
            if kind != IDLE:
                done[(kind, m, r * P + stage)] = tick
                position[stage] += 1
        rows.append(row)
        tick += 1
    return _with_slots(schedule, rows, done)


def _with_slots(schedule: Schedule, rows, done) -> ActionTable:
    """Assign stash slots: an item holds one on its stage from the arrival of its input
    (or its F, on the first virtual stage) to its last backward action."""
    P, R = schedule.stages, schedule.repeats
    V = P * R
    ticks = len(rows)
    shape = (ticks, P)
    table = {name: np.zeros(shape, np.int32) for name in ("action", "microbatch", "repeat", "slot")}
    arrive_input = np.full(shape, -1, np.int32)
    arrive_grad = np.full(shape, -1, np.int32)
    for tick, row in enumerate(rows):
        for stage, (kind, m, r) in enumerate(row):
            table["action"][tick, stage] = kind
            table["microbatch"][tick, stage] = m
            table["repeat"][tick, stage] = r

    def last_backward(m: int, v: int) -> int:
        return max(done.get((kind, m, v), -1) for kind in (B, W, BW))

    events = {stage: [] for stage in range(P)}  # (start, end, m, r)
    for (kind, m, v), tick in done.items():
        if kind != F:
            continue
        stage, r = v % P, v // P
        start = tick if v == 0 else done[(F, m, v - 1)] + 1
        events[stage].append((start, last_backward(m, v), m, r))
    slots = 0
    slot_of: dict[tuple[int, int, int], int] = {}
    for stage, lives in events.items():
        free_at: list[int] = []  # per slot: the first tick it is free again
        for start, end, m, r in sorted(lives):
            slot = next((s for s, free in enumerate(free_at) if free <= start), len(free_at))
            if slot == len(free_at):
                free_at.append(0)
            free_at[slot] = end + 1
            slot_of[(stage, m, r)] = slot
        slots = max(slots, len(free_at))
    for tick, row in enumerate(rows):
        for stage, (kind, m, r) in enumerate(row):
            if kind != IDLE:
                table["slot"][tick, stage] = slot_of[(stage, m, r)]
    for (kind, m, v), tick in done.items():
        if kind == F and v < V - 1 and tick + 1 < ticks:
            stage, r = (v + 1) % P, (v + 1) // P
            arrive_input[tick + 1, stage] = slot_of[(stage, m, r)]
        if kind in (B, BW) and v > 0 and tick + 1 < ticks:
            stage, r = (v - 1) % P, (v - 1) // P
            arrive_grad[tick + 1, stage] = slot_of[(stage, m, r)]
    return ActionTable(
        **table, arrive_input=arrive_input, arrive_grad=arrive_grad, slots=max(slots, 1)
    )
