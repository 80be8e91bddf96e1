"""Each action priced by its matrix FLOPs in the 1F1B-family executor's traced step
(`eqxzoo.parallel.action_costs`), and the schedules' lockstep model priced with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.parallel.action_costs import (
    action_flops,
    branch_matmul_flops,
    measured_action_flops,
    measured_bubble_fraction,
    measured_step_time,
    pricing_schedule,
)
from eqxzoo.parallel.pipeline_grad import action_scope
from eqxzoo.parallel.schedule import BW, IDLE, RECOMPUTE, B, Costs, F, W
from eqxzoo.run.plan import step_tracer
from eqxzoo.train.layout import to_pipeline_layout
from eqxzoo.train.loss import pipelined_loss_and_grad
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import abstract_train_state
from models import registry


@pytest.fixture(scope="module")
def measured():
    """The action FLOPs of 1f1b's, zb_h1's and zb_v's steps (P = 2, M = 2, stage remat on) of
    a tiny 4-layer llama, each traced once (nothing compiled)."""
    config = registry.tiny_config("llama", n_layers=4)
    model = models.DecoderLM(config, key=jax.random.key(0))
    mesh = make_mesh(MeshConfig(pp=2), jax.devices()[:2])
    ids = jnp.zeros((2, 2, 8), jnp.int32)
    flops = {}
    for name, repeats in (("1f1b", 1), ("zb_h1", 1), ("zb_v", 2)):
        step = StepConfig(schedule=Schedule(name, 2, 2, repeats), remat_stages=True)

        def loss_and_grad(model, step=step):
            return pipelined_loss_and_grad(model, ids, ids, config=step, mesh=mesh)

        staged = to_pipeline_layout(model, step.schedule)
        flops[name] = action_flops(jax.make_jaxpr(loss_and_grad)(staged))
    return flops


def test_with_stage_remat_r_recomputes_and_every_split_action_costs_about_a_forward(measured):
    zero_bubble, one_f_one_b = measured["zb_h1"], measured["1f1b"]
    assert zero_bubble.forward == one_f_one_b.forward == zero_bubble.recompute
    # R is the forward again; B the input half of the backward, W the weight half: each
    # about a forward, which is what a lockstep tick needs (1F1B's BW is three).
    for action in (zero_bubble.input_grad, zero_bubble.weight_grad):
        assert 0.8 * zero_bubble.forward < action < 1.25 * zero_bubble.forward
    # Each program has only the actions its table names.
    assert zero_bubble.both is None
    assert one_f_one_b.input_grad is None and one_f_one_b.weight_grad is None
    assert one_f_one_b.recompute is None
    # The head and loss are the last stage's extra, not part of F.
    assert zero_bubble.head == one_f_one_b.head > 0


def test_b_and_w_do_the_work_of_one_bw(measured):
    zero_bubble, one_f_one_b = measured["zb_h1"], measured["1f1b"]
    split = zero_bubble.recompute + zero_bubble.input_grad + zero_bubble.weight_grad
    np.testing.assert_allclose(split, one_f_one_b.both, rtol=0.05)
    # A rematerialised stage's BW: its forward again, then a backward of twice its work.
    np.testing.assert_allclose(one_f_one_b.both, 3 * one_f_one_b.forward, rtol=0.05)
    costs = zero_bubble.costs()
    assert costs.both is None and costs.prices()[BW] == costs.input_grad + costs.weight_grad


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "gpipe"])
def test_the_measured_bubble_is_the_table_priced_by_hand(measured, name):
    """At P = 4, M = 8: every tick costs its slowest stage's action in FLOPs, a stage is busy
    for the sum of its own; gpipe is priced with 1f1b's F and BW."""
    schedule = Schedule(name, 4, 8, 1).for_stage_remat(True)
    flops = measured[pricing_schedule(schedule).name]
    price = {IDLE: 0, F: flops.forward, B: flops.input_grad, W: flops.weight_grad}
    price[BW] = flops.both if flops.both is not None else flops.input_grad + flops.weight_grad
    price[RECOMPUTE] = flops.recompute
    actions = schedule.actions().action
    step = sum(max(price[int(kind)] for kind in row) for row in actions)
    busy = sum(price[int(kind)] for kind in actions[:, 0])
    assert all(sum(price[int(kind)] for kind in actions[:, p]) == busy for p in range(4))
    np.testing.assert_allclose(measured_bubble_fraction(schedule, flops), 1 - busy / step)
    np.testing.assert_allclose(measured_step_time(schedule, flops), step / flops.forward)


def test_r_keeps_zero_bubbles_lead_when_b_would_recompute(measured):
    """At P = 4, M = 8 with stage remat. A B that recomputed the forward itself would cost
    about twice its W, and in lockstep every tick with a B would wait for it (priced so,
    ZB-H1's bubble is 0.38 against 1F1B's 0.45, not its unit-cost 1/9); with R apart every
    action costs about a forward and zero bubble keeps its lead: ZB-H1 under half of
    1F1B's bubble, ZB-V under ZB-H1's."""
    one_f_one_b = measured_bubble_fraction(Schedule("1f1b", 4, 8, 1), measured["1f1b"])
    zero_bubble = {
        name: measured_bubble_fraction(
            Schedule(name, 4, 8, r).for_stage_remat(True), measured[name]
        )
        for name, r in (("zb_h1", 1), ("zb_v", 2))
    }
    np.testing.assert_allclose(Schedule("zb_h1", 4, 8, 1).bubble_fraction(), 1 / 9)
    flops = measured["zb_h1"]
    recomputing_b = Costs(
        forward=1.0,
        input_grad=(flops.recompute + flops.input_grad) / flops.forward,
        weight_grad=flops.weight_grad / flops.forward,
    )
    assert Schedule("zb_h1", 4, 8, 1).bubble_fraction(recomputing_b) > 0.8 * one_f_one_b
    assert zero_bubble["zb_v"] < zero_bubble["zb_h1"] < 0.5 * one_f_one_b
    # A table priced by a program it does not match is refused.
    with pytest.raises(ValueError, match="the measured program has R .* runs no R"):
        measured_bubble_fraction(Schedule("zb_h1", 4, 8, 1), flops)


def test_modelled_time_with_non_unit_costs_by_hand():
    """P = 2, M = 2. zb_h1's ticks (stage 0, stage 1): F -, F F, - B, B F, W B, B W, W W; at
    F = W = 1, B = 2 their slowest actions cost 1 1 2 2 2 2 1 = 11, a stage's work 8.
    1f1b's: F -, F F, - BW, BW F, - BW, BW -; at F = 1, BW = 3: 1 1 3 3 3 3 = 14 for 8."""
    assert Schedule("zb_h1", 2, 2, 1).actions().action.tolist() == [
        [F, IDLE], [F, F], [IDLE, B], [B, F], [W, B], [B, W], [W, W]
    ]  # fmt: skip
    assert Schedule("1f1b", 2, 2, 1).actions().action.tolist() == [
        [F, IDLE], [F, F], [IDLE, BW], [BW, F], [IDLE, BW], [BW, IDLE]
    ]  # fmt: skip
    zero_bubble_costs = Costs(forward=1.0, input_grad=2.0, weight_grad=1.0)
    assert Schedule("zb_h1", 2, 2, 1).modelled_time(zero_bubble_costs) == 11
    np.testing.assert_allclose(
        Schedule("zb_h1", 2, 2, 1).bubble_fraction(zero_bubble_costs), 1 - 8 / 11
    )
    one_f_one_b_costs = Costs(forward=1.0, both=3.0)
    assert Schedule("1f1b", 2, 2, 1).modelled_time(one_f_one_b_costs) == 14
    np.testing.assert_allclose(
        Schedule("1f1b", 2, 2, 1).bubble_fraction(one_f_one_b_costs), 1 - 8 / 14
    )


def test_forward_schedules_are_priced_by_the_1f1b_step(measured):
    assert pricing_schedule(Schedule("gpipe", 4, 8, 1)) == Schedule("1f1b", 4, 8, 1)
    assert pricing_schedule(Schedule("circular", 4, 8, 2)) == Schedule("1f1b", 4, 8, 1)
    interleaved = Schedule("interleaved_1f1b", 4, 8, 2)
    assert pricing_schedule(interleaved) == interleaved
    # 1f1b's step has no B or W: it cannot price a table that runs them.
    with pytest.raises(ValueError, match="the zb_h1 table runs B, W, which the measured"):
        measured_bubble_fraction(Schedule("zb_h1", 4, 8, 1), measured["1f1b"])
    with pytest.raises(ValueError, match="no conditionals of the actions F, B, W, BW, R"):
        action_flops(jax.make_jaxpr(jnp.dot)(jnp.ones((2, 2)), jnp.ones((2, 2))))


def test_the_dry_run_prices_circular_with_the_1f1b_train_step(measured):
    """`eqxzoo.run.plan.step_tracer` traces the whole train step on abstract arrays; for a
    forward schedule, the 1f1b step of the same model, mesh and batch: its actions are the
    executor's alone (the fixture's, traced without the optimizer)."""
    config = registry.tiny_config("llama", n_layers=4)
    mesh = make_mesh(MeshConfig(pp=2), jax.devices()[:2])
    step = StepConfig(schedule=Schedule("circular", 2, 2, 2))
    make_model = models.model_factory(config)
    state = abstract_train_state(make_model, config=step, mesh=mesh)
    trace = step_tracer(step, mesh, make_model, state, (1, 2, 2, 8))
    assert measured_action_flops(step.schedule, trace) == measured["1f1b"]


def test_conditionals_the_executor_chooses_by_stage_count_their_cheaper_branch():
    """A stand-in for the executor's tick: each action a conditional in its name scope
    (`action_scope`). F's top-level conditional (the head, on the last stage) counts its
    cheaper branch, its extra going to ``head``; a conditional inside the layers (a scan of
    3) counts its dearest; an action with no conditional (W, R) is absent."""
    n = 4
    one_matmul = 2 * n**3

    def step(kind, last_stage, x, w):
        def forward(x):
            h = x @ w
            return jax.lax.cond(last_stage, lambda: h @ w @ w, lambda: h)

        def input_grad(x):
            def layer(h, _):
                return jax.lax.cond(h.sum() > 0, lambda: h @ w @ w, lambda: h @ w), None

            return jax.lax.scan(layer, x, None, length=3)[0]

        def both(x):
            return x @ w @ w @ w

        for action, run in ((F, forward), (B, input_grad), (BW, both)):
            with jax.named_scope(action_scope(action)):
                x = jax.lax.cond(kind == action, run, lambda x: x, x)
        return x

    jaxpr = jax.make_jaxpr(step)(0, True, jnp.ones((n, n)), jnp.ones((n, n))).jaxpr
    flops = action_flops(jaxpr)
    assert flops.by_action() == {
        "F": one_matmul,
        "B": 3 * 2 * one_matmul,
        "W": None,
        "BW": 3 * one_matmul,
        "R": None,
    }
    assert flops.head == 2 * one_matmul
    assert flops.ratio() == "F:B:BW = 1:6:3"
    assert branch_matmul_flops(jaxpr) == [0, one_matmul, 6 * one_matmul, 0, 3 * one_matmul, 0]
