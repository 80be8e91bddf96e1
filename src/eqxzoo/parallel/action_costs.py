"""What each pipeline action costs, measured on the program that runs it, and the schedules
priced with it.

`Schedule.modelled_time` and `Schedule.bubble_fraction` price a table with `Costs`: by
default F = B = W = R = 1 and BW = 2. The program's actions cost otherwise: with stage remat
a BW recomputes the stage's forward first (a split schedule's B has an R of its own for
that), a W is only the weight half of the backward.
Here the costs come from the 1F1B-family executor itself (`eqxzoo.parallel.pipeline_grad`):
each tick it runs each action its table names in a conditional of its own, in the name
scope `action_scope` gives, so the traced step holds each action's program as that
conditional's branch, and the branch's matrix FLOPs are its price (`action_flops`). Forward
schedules (``gpipe``, ``circular``) have no such actions:
autodiff differentiates their forward table. They are priced with the step of the 1F1B
schedule over the same stages and microbatches (`pricing_schedule`), whose F and BW are a
stage's forward and its whole backward, as theirs are.

Only matrix multiplications are counted (``dot_general`` and grouped ``ragged_dot_general``,
`eqxzoo.parallel.backward_split.matmul_flops`). On accelerators they run on the matrix units
at 10-20x the rate of everything else, whose time follows its memory traffic, not its FLOPs:
adding the elementwise work (norms, softmax, activations: ``O(T d)`` a layer against the
matmuls' ``O(T d^2)``) would add a figure that predicts its time no better. (The compiled
program's ``cost_analysis()`` counts all FLOPs but a conditional by one branch only, so it
cannot price the branches apart.) The FLOPs are a whole stage's, over its ``dp`` and ``tp``
devices together: the executor's `jax.shard_map` is manual over ``pp`` alone. Only their
ratios enter the model.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np
from jax.extend import core

from eqxzoo.parallel.backward_split import _inner_jaxprs, matmul_flops
from eqxzoo.parallel.pipeline_grad import action_scope
from eqxzoo.parallel.schedule import ACTION_NAMES, BW, IDLE, RECOMPUTE, B, Costs, F, Schedule, W

MATMULS = ("dot_general", "ragged_dot_general")


@dataclasses.dataclass(frozen=True)
class ActionFlops:
    """Matrix FLOPs of one stage's action on one chunk of layers, as traced:
    F (``forward``), B (``input_grad``), W (``weight_grad``), BW (``both``), R
    (``recompute``); None for an action the program does not have (1F1B has no B, W or R,
    ZB-H1 no BW, and R only with stage remat). ``head`` is what the last
    virtual stage adds to its F (the head, the loss and their backward), left out of F: the
    table prices an action alike on every stage, and the head is one stage's extra, not the
    action's."""

    forward: int
    input_grad: int | None
    weight_grad: int | None
    both: int | None
    recompute: int | None = None
    head: int = 0

    def by_action(self) -> dict[str, int | None]:
        """``{"F", "B", "W", "BW", "R"}`` -> FLOPs (None where the program has no such
        action)."""
        values = (self.forward, self.input_grad, self.weight_grad, self.both, self.recompute)
        kinds = (F, B, W, BW, RECOMPUTE)
        return dict(zip((ACTION_NAMES[kind] for kind in kinds), values, strict=True))

    def relative(self) -> dict[str, float | None]:
        """`by_action` in units of F."""
        return {
            name: None if flops is None else flops / self.forward
            for name, flops in self.by_action().items()
        }

    def costs(self) -> Costs:
        """The `Costs` these FLOPs give, in units of F. A B or W the program does not have
        costs NaN, so that a table running it is priced NaN, never with a made-up figure
        (`measured_bubble_fraction` refuses it); a BW it does not have is B plus W, as
        `Costs` prices it."""
        relative = self.relative()

        def cost(name: str) -> float:
            return math.nan if relative[name] is None else relative[name]

        return Costs(
            forward=1.0,
            input_grad=cost("B"),
            weight_grad=cost("W"),
            both=relative["BW"],
            recompute=cost("R"),
        )

    def ratio(self) -> str:
        """The program's actions in units of F (`cost_ratio`)."""
        return cost_ratio(self.relative())


def cost_ratio(relative: Mapping[str, float | None]) -> str:
    """Actions' costs in units of F as one ratio, e.g. ``"F:B:W = 1:2.06:0.94"`` (the actions
    that have a cost, in order)."""
    present = {name: value for name, value in relative.items() if value is not None}
    return ":".join(present) + " = " + ":".join(f"{value:.3g}" for value in present.values())


def action_flops(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> ActionFlops:
    """Each action's matrix FLOPs in a traced step of the 1F1B-family executor, e.g.
    ``jax.make_jaxpr(step)(...).jaxpr`` or ``jax.jit(step).trace(...).jaxpr``.

    The action's program is the taken branch of its conditional (`action_branches`); an
    action the table never names has none. Conditionals at the top of a branch are the
    executor's choice of the stage's part (the embedding on the first virtual stage, the head
    and loss on the last): they count their cheaper branch, a middle stage's, the head's extra
    going to ``head``. Conditionals inside the layers (an MoE layer's overflow path) count
    their dearest branch, what a tick may have to wait for. A ``scan`` counts its body
    ``length`` times; a ``while`` loop once.
    """
    branches = action_branches(jaxpr)
    if F not in branches:
        raise ValueError(
            "the traced step has no conditionals of the actions F, B, W, BW, R: it is not a "
            "step of the 1F1B-family executor (price a forward schedule with the step of "
            "`pricing_schedule`)"
        )
    cheapest = {kind: _branch_flops(branch, min) for kind, branch in branches.items()}
    dearest = _branch_flops(branches[F], max)

    def present(kind: int) -> int | None:
        return cheapest.get(kind)

    assert cheapest[F] > 0, "a stage whose forward does no matrix work"
    return ActionFlops(
        forward=cheapest[F],
        input_grad=present(B),
        weight_grad=present(W),
        both=present(BW),
        recompute=present(RECOMPUTE),
        head=dearest - cheapest[F],
    )


def branch_matmul_flops(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> list[int]:
    """`action_flops` as a list indexed by action (IDLE, F, B, W, BW, R; 0 where the program
    has no such action, all 0 when the step is not the 1F1B-family executor's)."""
    branches = action_branches(jaxpr)
    return [_branch_flops(branches[kind], min) if kind in branches else 0 for kind in ACTION_NAMES]


def action_branches(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> dict[int, core.Jaxpr]:
    """``{action: program}``: the taken branch of each conditional in an action's name scope
    (`eqxzoo.parallel.pipeline_grad.action_scope`), nested jaxprs included; the first of
    each (every tick traces the same)."""
    if isinstance(jaxpr, core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    scopes = {action_scope(kind): kind for kind in ACTION_NAMES if kind != IDLE}
    found: dict[int, core.Jaxpr] = {}
    for eqn in jaxpr.eqns:
        scope = str(eqn.source_info.name_stack).rsplit("/", 1)[-1]
        if eqn.primitive.name == "cond" and scope in scopes:
            found.setdefault(scopes[scope], eqn.params["branches"][-1].jaxpr)
            continue
        for inner in _inner_jaxprs(eqn.params):
            for kind, branch in action_branches(inner).items():
                found.setdefault(kind, branch)
    return found


def _branch_flops(branch: core.Jaxpr, choose: Callable[[list[int]], int]) -> int:
    """An action's matrix FLOPs: its top-level conditionals by ``choose`` over their
    branches, everything else by `_matrix_flops`."""
    total = 0
    for eqn in branch.eqns:
        if eqn.primitive.name == "cond":
            total += choose([_matrix_flops(b.jaxpr.eqns) for b in eqn.params["branches"]])
        else:
            total += _matrix_flops([eqn])
    return total


def _matrix_flops(eqns) -> int:
    """`matmul_flops` of ``eqns``, a conditional counting its dearest branch (not all)."""
    total = 0
    for eqn in eqns:
        name = eqn.primitive.name
        if name in MATMULS:
            total += matmul_flops([eqn])
        elif name == "cond":
            total += max(_matrix_flops(branch.jaxpr.eqns) for branch in eqn.params["branches"])
        else:
            repeats = eqn.params.get("length", 1) if name == "scan" else 1
            total += repeats * sum(_matrix_flops(inner.eqns) for inner in _inner_jaxprs(eqn.params))
    return total


def pricing_schedule(schedule: Schedule) -> Schedule:
    """The 1F1B-family schedule whose step prices ``schedule``'s actions: itself, or for a
    forward schedule ``1f1b`` over the same stages and microbatches, one repeat (its F and
    BW: a whole stage's forward and its backward, as autodiff runs them)."""
    if schedule.fuses_backward:
        return schedule
    return Schedule("1f1b", schedule.stages, schedule.microbatches, 1)


def measured_action_flops(
    schedule: Schedule, trace: Callable[[Schedule], core.Jaxpr | core.ClosedJaxpr]
) -> ActionFlops:
    """The action FLOPs that price ``schedule``: those of ``trace(pricing_schedule(schedule))``,
    the traced step of the same model, mesh and batch under that schedule (``trace`` knows
    them; nothing need be compiled)."""
    return action_flops(trace(pricing_schedule(schedule)))


def measured_step_time(schedule: Schedule, flops: ActionFlops) -> float:
    """`Schedule.modelled_time` (in units of the measured F) priced with ``flops``."""
    return schedule.modelled_time(_costs_for(schedule, flops))


def measured_bubble_fraction(schedule: Schedule, flops: ActionFlops) -> float:
    """`Schedule.bubble_fraction` priced with ``flops``."""
    return schedule.bubble_fraction(_costs_for(schedule, flops))


def _costs_for(schedule: Schedule, flops: ActionFlops) -> Costs:
    """``flops``' `Costs`, checked to price every action ``schedule``'s table runs."""
    if schedule.splits_backward and schedule.recompute != (flops.recompute is not None):
        has = "has" if flops.recompute is not None else "has no"
        raise ValueError(
            f"the measured program {has} R ({flops.ratio()}), the {schedule.name} table "
            f"{'runs' if schedule.recompute else 'runs no'} R: price the schedule as the step "
            "runs it (`Schedule.for_stage_remat`)"
        )
    costs = flops.costs()
    prices = costs.prices()
    runs = np.unique(schedule.actions().action)
    unpriced = [ACTION_NAMES[int(kind)] for kind in runs if not np.isfinite(prices[kind])]
    if unpriced:
        raise ValueError(
            f"the {schedule.name} table runs {', '.join(unpriced)}, which the measured program "
            f"does not have ({flops.ratio()}): measure the step of `pricing_schedule`"
        )
    return costs
