"""Pipeline schedules as data: static tables of (tick, stage) -> what the stage does.

The layers are viewed as ``[repeats R, stages P, layers_per_stage]``: chunk ``r`` of stage
``p`` holds the ``k`` layers of one *virtual stage* ``v`` (layers ``v k .. (v + 1) k - 1``),
which a microbatch visits in the order ``v = 0 .. R P - 1``. Where each virtual stage sits is
the schedule's *placement* (`Schedule.virtual_stages`):

- looped (every schedule but ``zb_v``): ``v = r P + p``, a microbatch passes through stages
  ``0..P-1`` once per repeat, around the ring;
- V-shaped (``zb_v``, ``R = 2``): stage ``p`` holds ``v = p`` and ``v = 2P - 1 - p``, a
  microbatch goes down the stages and back up, so the last virtual stage (the loss) sits on
  stage 0 beside the first, and the hand-over between the two halves stays on stage
  ``P - 1``.

Every stage acts in lockstep, one action per tick.

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
- ``zb_v`` (zero bubble, V-shaped placement, ``R = 2``): the stage orders come from a greedy
  lockstep list schedule (`_zero_bubble_v_orders`): each tick a stage runs a ready B, else a
  ready F while fewer than ``2P`` of its chunks are between their F and their W, else its
  oldest pending W. With the loss beside the first stage the backward starts where the
  forward did, and Ws fill what is left: a bubble of 0.077 at P = 4, M = 8 (unit costs)
  with at most ``2P + 2`` chunks of half a stage in its stash (counted from their arrival),
  one stage's worth more than 1F1B's first stage.

With stage remat the split schedules (``zb_h1``, ``zb_v``) run an R before each B
(`Schedule.for_stage_remat`): the stage's forward again, keeping what B reads, so that no
tick waits for a B that recomputes; the R runs beside the B above that computes its
cotangent, and ZB-H1 then defers its Ws by ``p - 1`` Bs to keep ``P`` in flight (ZB-V's
unit-cost bubble at P = 4, M = 8 becomes 0.045).

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

ScheduleName = Literal["gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"]

IDLE, F, B, W, BW, RECOMPUTE = 0, 1, 2, 3, 4, 5
ACTION_NAMES = {IDLE: "idle", F: "F", B: "B", W: "W", BW: "BW", RECOMPUTE: "R"}
# Where what a stage receives was sent from (`ActionTable.arrive_input`, ``arrive_grad``).
FROM_BELOW, FROM_ABOVE, FROM_SELF = 0, 1, 2
SOURCES = (FROM_BELOW, FROM_ABOVE, FROM_SELF)


class ScheduleError(UserError, ValueError):
    """An impossible (schedule, stages, microbatches, repeats) combination."""


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of one stage's action on a whole stage's layers, in units of a forward:
    F (``forward``), B (``input_grad``), W (``weight_grad``), BW (``both``; ``None``: B
    plus W, as when the backward is cut into B and W without repeating work) and R
    (``recompute``: the forward again, keeping what B needs)."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0
    both: float | None = None
    recompute: float = 1.0

    def prices(self) -> np.ndarray:
        """The cost of each action kind, indexed by IDLE, F, B, W, BW, R."""
        price = np.zeros(len(ACTION_NAMES))
        price[F] = self.forward
        price[B] = self.input_grad
        price[W] = self.weight_grad
        price[BW] = self.input_grad + self.weight_grad if self.both is None else self.both
        price[RECOMPUTE] = self.recompute
        return price


@dataclasses.dataclass(frozen=True)
class ActionTable:
    """A forward-and-backward schedule, each array ``(ticks, stages)``.

    ``action`` (IDLE, F, B, W, BW, R), ``microbatch`` and ``repeat`` (chunk) of the item acted
    on, ``slot``: its stash slot. What a stage sent at the tick before arrives from one of
    three ``SOURCES`` (`FROM_BELOW`: stage ``p - 1``, around the ring; `FROM_ABOVE`: stage
    ``p + 1``; `FROM_SELF`: the stage itself, on a V's turn), each ``(3, ticks, stages)``:
    ``arrive_input[source]`` / ``arrive_grad[source]``, the slot where an activation
    (cotangent) from that source lands, or -1. ``slots`` is the stash size (the most items
    in flight on a stage).
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
    """A schedule of ``stages`` over ``microbatches`` and ``repeats`` chunks per stage.
    ``recompute`` (schedules that cut the backward into B and W, with stage remat): each B
    is preceded by an action of its own, R, that runs the stage's forward again and keeps
    what B reads, so that a B costs a backward, not a forward and a backward: in lockstep a
    tick waits for its slowest action (`for_stage_remat` sets it)."""

    name: ScheduleName
    stages: int
    microbatches: int
    repeats: int
    recompute: bool = False

    def __post_init__(self):
        check_fields(self)
        if self.stages < 1 or self.microbatches < 1 or self.repeats < 1:
            raise ScheduleError(
                f"stages, microbatches and repeats must be >= 1, got "
                f"{self.stages}, {self.microbatches}, {self.repeats}"
            )
        self.spec.check(self)
        if self.recompute and not self.splits_backward:
            raise ScheduleError(
                f"the {self.name} schedule has no B of its own to recompute for: "
                "recompute needs zb_h1 or zb_v",
                field="recompute",
            )

    def for_stage_remat(self, remat_stages: bool) -> "Schedule":
        """The schedule the 1F1B-family executor runs with ``remat_stages``: with a recompute
        action before each B where the schedule splits the backward."""
        return dataclasses.replace(self, recompute=remat_stages and self.splits_backward)

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule cuts each backward into B and W (the zero-bubble ones)."""
        return self.spec.splits_backward

    @property
    def spec(self) -> "ScheduleSpec":
        return SCHEDULES[self.name]

    @property
    def virtual_stages(self) -> np.ndarray:
        """``(R, P)``: the virtual stage that chunk ``r`` of stage ``p`` holds."""
        return self.spec.placement(self.stages, self.repeats)

    def place(self, virtual_stage: int) -> tuple[int, int]:
        """``(stage, chunk)`` where ``virtual_stage`` sits."""
        (chunk,), (stage,) = np.nonzero(self.virtual_stages == virtual_stage)
        return int(stage), int(chunk)

    @property
    def fuses_backward(self) -> bool:
        """Whether the schedule runs the backward itself (the 1F1B family)."""
        return self.spec.fuses_backward

    @property
    def forward_only(self) -> "Schedule":
        """The forward schedule over the same stages, microbatches and repeats (``gpipe`` or
        ``circular``, looped): what evaluation, which needs no backward, runs (``zb_v``'s
        layers are first moved to the looped placement: `restage_layers`)."""
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
        price = costs.prices()
        return float(price[self.actions().action].max(axis=1).sum() / self.repeats)

    def modelled_work(self, costs: Costs = Costs()) -> float:
        """A stage's own work in the lockstep model: the mean over stages of its actions'
        costs (``3 M`` stage forwards at unit costs, ``4 M`` with R)."""
        return float(costs.prices()[self.actions().action].sum() / (self.stages * self.repeats))

    def bubble_fraction(self, costs: Costs = Costs()) -> float:
        """The idle share of the modelled step: ``1 - work / modelled_time``."""
        return 1.0 - self.modelled_work(costs) / self.modelled_time(costs)

    def in_flight(self) -> int:
        """The most microbatch chunks a stage keeps at once (its stash, in chunks of ``1/R``
        of a stage); forward schedules keep every one until the backward."""
        return self.actions().slots


def stage_orders(schedule: Schedule) -> list[list[tuple[int, int, int]]]:
    """Each stage's actions ``(kind, microbatch, repeat)`` in the order it runs them (with
    ``recompute``, an R right before each B)."""
    P, M, spec = schedule.stages, schedule.microbatches, schedule.spec
    extra = {"recompute": schedule.recompute} if spec.splits_backward else {}
    return [spec.stage_order(P, M, schedule.repeats, stage, **extra) for stage in range(P)]


Action = tuple[int, int, int]  # (kind, microbatch, repeat)


def _looped(P: int, R: int) -> np.ndarray:
    return np.arange(R * P).reshape(R, P)


def _v_shaped(P: int, R: int) -> np.ndarray:
    return np.stack([np.arange(P), np.arange(2 * P - 1, P - 1, -1)])


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its ``name``; whether the 1F1B-family executor runs it
    (``fuses_backward``; else its forward table is differentiated by autodiff); ``check``,
    which refuses the (stages, microbatches, repeats) it cannot run with a `ScheduleError`;
    ``stage_order(P, M, R, stage)``, the stage's actions in the order it runs them, from
    which the action table (and a forward schedule's forward table) is built; and
    ``placement(P, R)``, the ``(R, P)`` virtual stage of each chunk of each stage;
    ``splits_backward``: whether its backward is cut into B and W (its ``stage_order`` then
    takes ``recompute``: an R before each B)."""

    name: str
    fuses_backward: bool
    check: Callable[[Schedule], None]
    stage_order: Callable[..., list[Action]]
    placement: Callable[[int, int], np.ndarray] = _looped
    splits_backward: bool = False


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


def _zero_bubble_h1(P: int, M: int, R: int, stage: int, recompute: bool) -> list[Action]:
    """1F1B's order with each BW cut into B and W, the Ws deferred by ``stage`` Bs; with
    ``recompute`` an R before each B, and the Ws deferred one B less: each B then runs a
    tick later, and deferring by ``stage`` would keep one more microbatch in flight than
    1F1B's ``P`` (at P = 4, M = 8: bubble 0.111 at unit costs with 4 in flight; with R 0.111
    with 4, where deferring by ``stage`` gives 0.086 with 5)."""
    delay = max(stage - 1, 0) if recompute else stage
    order = _split_and_defer_weight_grads(_one_f_one_b(P, M, R, stage), delay=delay)
    if not recompute:
        return order
    return [
        action
        for kind, m, r in order
        for action in [(RECOMPUTE, m, r)] * (kind == B) + [(kind, m, r)]
    ]


def _check_v(schedule: Schedule) -> None:
    if schedule.repeats != 2:
        raise ScheduleError(
            f"the zb_v schedule places two chunks on each stage (a V), got "
            f"repeats={schedule.repeats}: set pipeline.repeats = 2",
            field="repeats",
        )


def _zero_bubble_v(P: int, M: int, R: int, stage: int, recompute: bool) -> list[Action]:
    return _zero_bubble_v_orders(P, M, recompute)[stage]


@functools.lru_cache(maxsize=64)
def _zero_bubble_v_orders(P: int, M: int, recompute: bool) -> list[list[Action]]:
    """Every stage's ZB-V actions, from a greedy lockstep list schedule on the V placement.

    Each tick, each stage runs the first of: a ready B (the chunk nearer the loss first: the
    backward's critical path), a ready F while fewer than ``2P`` of its chunks are in flight
    (from F to W; the chunk nearer the loss first), its oldest pending W. An action is ready
    once what it reads was done at an earlier tick, as `_action_table` requires. With
    ``recompute`` a B is first an R, and the B follows at the next tick: the R runs once
    the B's cotangent is on its way (at the tick the B above runs, in place of an F or a W),
    so the backward still moves one stage a tick.
    """
    placement = _v_shaped(P, 2)
    where = {int(placement[chunk, stage]): (stage, chunk) for chunk in (0, 1) for stage in range(P)}
    last = 2 * P - 1
    done: dict[tuple[int, int, int], int] = {}  # (kind, m, virtual stage) -> tick
    orders: list[list[Action]] = [[] for _ in range(P)]
    next_forward = [[0, 0] for _ in range(P)]
    next_backward = [[0, 0] for _ in range(P)]
    pending = [[] for _ in range(P)]  # per stage: (m, chunk) whose W is still to run
    in_flight = [0] * P
    recomputed: list[Action | None] = [None] * P  # per stage: the B its R was for

    def before(key, tick: int) -> bool:
        return done.get(key, tick) < tick

    def choose(stage: int, tick: int) -> Action | None:
        if recomputed[stage] is not None:
            return recomputed[stage]
        for chunk in (1, 0):
            m, v = next_backward[stage][chunk], int(placement[chunk, stage])
            if m < M and before((F, m, v), tick) and (v == last or before((B, m, v + 1), tick)):
                return (RECOMPUTE if recompute else B, m, chunk)
        if in_flight[stage] < 2 * P:
            for chunk in (1, 0):
                m, v = next_forward[stage][chunk], int(placement[chunk, stage])
                if m < M and (v == 0 or before((F, m, v - 1), tick)):
                    return (F, m, chunk)
        if pending[stage]:
            return (W, *pending[stage][0])
        return None

    def recompute_ahead(stage: int, row: list[Action | None]) -> Action | None:
        """An R whose B's cotangent is being computed at this tick (by ``row``), if any."""
        for chunk in (1, 0):
            m, v = next_backward[stage][chunk], int(placement[chunk, stage])
            if m < M and v < last and before((F, m, v), tick):
                above, above_chunk = where[v + 1]
                if row[above] == (B, m, above_chunk):
                    return (RECOMPUTE, m, chunk)
        return None

    tick = 0
    while any(len(order) < (3 + recompute) * M * 2 for order in orders):
        row = [choose(stage, tick) for stage in range(P)]
        if recompute:
            row = [
                (recompute_ahead(stage, row) or action)
                if action is None or action[0] in (F, W)
                else action
                for stage, action in enumerate(row)
            ]
        assert any(row), f"zb_v P={P} M={M}: the greedy schedule stalls at tick {tick}"
        for stage, action in enumerate(row):
            if action is None:
                continue
            kind, m, chunk = action
            done[(kind, m, int(placement[chunk, stage]))] = tick
            orders[stage].append(action)
            if kind == F:
                next_forward[stage][chunk] += 1
                in_flight[stage] += 1
            elif kind == RECOMPUTE:
                recomputed[stage] = (B, m, chunk)
            elif kind == B:
                recomputed[stage] = None
                next_backward[stage][chunk] += 1
                pending[stage].append((m, chunk))
            else:
                pending[stage].pop(0)
                in_flight[stage] -= 1
        tick += 1
    return orders


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", False, _one_repeat, _forward_then_backward),
        ScheduleSpec("circular", False, _check_circular, _forward_then_backward),
        ScheduleSpec("1f1b", True, _one_repeat, _one_f_one_b),
        ScheduleSpec("interleaved_1f1b", True, _check_interleaved, _interleaved_one_f_one_b),
        ScheduleSpec("zb_h1", True, _one_repeat, _zero_bubble_h1, splits_backward=True),
        ScheduleSpec("zb_v", True, _check_v, _zero_bubble_v, _v_shaped, splits_backward=True),
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
    placement = schedule.virtual_stages
    orders = stage_orders(schedule)
    done: dict[tuple[int, int, int], int] = {}  # (kind, m, virtual stage) -> tick
    position = [0] * P
    rows: list[list[tuple[int, int, int]]] = []

    def ready(kind: int, m: int, r: int, stage: int, tick: int, row) -> bool:
        v = int(placement[r, stage])
        if kind == F:
            return v == 0 or done.get((F, m, v - 1), tick) < tick
        if kind in (B, BW, RECOMPUTE):
            after_forward = done.get((F, m, v), tick) < tick
            if kind == B and schedule.recompute:
                after_forward = done.get((RECOMPUTE, m, v), tick) < tick
            if v == V - 1:
                return after_forward
            upstream = done.get((B, m, v + 1), done.get((BW, m, v + 1), tick))
            if kind == RECOMPUTE:  # it may run beside the B that computes its cotangent
                above, above_chunk = schedule.place(v + 1)
                return after_forward and (upstream < tick or row[above] == (B, m, above_chunk))
            return after_forward and upstream < tick
        return done.get((B, m, v), tick) < tick  # W

    tick = 0
    while any(position[stage] < len(orders[stage]) for stage in range(P)):
        row: list[tuple[int, int, int] | None] = [None] * P
        for _ in range(2):  # the second pass runs the Rs beside their cotangents' Bs
            for stage in range(P):
                if row[stage] is None and position[stage] < len(orders[stage]):
                    kind, m, r = orders[stage][position[stage]]
                    if ready(kind, m, r, stage, tick, row):
                        row[stage] = (kind, m, r)
        row = [(IDLE, 0, 0) if action is None else action for action in row]
        if all(kind == IDLE for kind, _, _ in row):
            raise AssertionError(f"{schedule}: the stage orders deadlock at tick {tick}")
        for stage, (kind, m, r) in enumerate(row):
            if kind != IDLE:
                done[(kind, m, int(placement[r, stage]))] = tick
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
    arrive_input = np.full((len(SOURCES), *shape), -1, np.int32)
    arrive_grad = np.full((len(SOURCES), *shape), -1, np.int32)
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
        stage, r = schedule.place(v)
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

    def source(sender: int, receiver: int) -> int:
        if sender == receiver:
            return FROM_SELF
        return FROM_BELOW if receiver == (sender + 1) % P else FROM_ABOVE

    for (kind, m, v), tick in done.items():
        sender, _ = schedule.place(v)
        if kind == F and v < V - 1 and tick + 1 < ticks:
            stage, r = schedule.place(v + 1)
            arrive_input[source(sender, stage), tick + 1, stage] = slot_of[(stage, m, r)]
        if kind in (B, BW) and v > 0 and tick + 1 < ticks:
            stage, r = schedule.place(v - 1)
            arrive_grad[source(sender, stage), tick + 1, stage] = slot_of[(stage, m, r)]
    return ActionTable(
        **table, arrive_input=arrive_input, arrive_grad=arrive_grad, slots=max(slots, 1)
    )
