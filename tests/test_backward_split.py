"""The backward pass cut in two (`eqxzoo.parallel.backward_split`), on one layer of the zoo's
families: B (the input cotangent) and W (the weight gradients, from B's stash alone) give
the pullback's values, and between them do exactly its matrix work, where the vjp with
respect to the weights alone repeats all of it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grids import FULL_GRIDS

import models
from eqxzoo.nn import apply_layers
from eqxzoo.nn.stack import remat
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.parallel.action_costs import action_flops
from eqxzoo.parallel.backward_split import (
    BackwardSplit,
    PullbackResiduals,
    matmul_flops,
    stage_forward,
    stage_input_grad,
    stage_weight_grad,
)
from eqxzoo.parallel.schedule import BW, RECOMPUTE, B, F, W
from eqxzoo.train.layout import to_pipeline_layout
from eqxzoo.train.loss import pipelined_loss_and_grad
from eqxzoo.train.settings import StepConfig
from models import registry

# Every kind of weight: attention, SwiGLU and norms with weights (llama, here rematerialised
# whole: its backward is one ``remat2`` equation, whose body is cut), biases, sinks and
# experts with biases (gpt_oss), routed and gated shared experts (qwen_moe), latent attention
# and grouped routing with its balancing bias, a buffer (deepseek_v3).
CASES = ["llama-remat", "gpt_oss", "qwen_moe", "deepseek_v3"]


def one_layer(case: str):
    """The first pipelined layer of the case's family's tiny model as ``layer(weights, h)``
    (under ``remat_policy = "full"`` for a ``-remat`` case), its float weights, an input."""
    family, _, remat_policy = case.partition("-")
    config = registry.tiny_config(family)
    layers = models.DecoderLM(config, key=jax.random.key(0)).blocks.layers
    weights, rest = eqx.partition(layers, eqx.is_inexact_array)
    weights = jax.tree.map(lambda leaf: leaf[0], weights)
    rest = jax.tree.map(lambda leaf: leaf[0] if eqx.is_array(leaf) else leaf, rest)
    h = jax.random.normal(jax.random.key(1), (2, 8, config.d_model))
    layer = remat(lambda w, x: eqx.combine(w, rest)(x), "full" if remat_policy else "none")
    return layer, weights, h


@pytest.mark.parametrize("case", CASES)
def test_b_and_w_split_the_backward_without_repeating_it(case, assert_trees_close):
    layer, weights, h = one_layer(case)
    outputs = jax.eval_shape(layer, weights, h)
    cotangent = jax.tree.map(
        lambda s: jax.random.normal(jax.random.key(2), s.shape, s.dtype), outputs
    )
    figures = {}

    @jax.jit
    def split_backward(weights, h, cotangent):
        split, residuals, cotangent_leaves = BackwardSplit.of(layer, weights, h, cotangent)
        d_h, stash = split.input_grad(residuals, cotangent_leaves)
        # W runs elsewhere: it rebuilds the same cut from shapes (on placeholder inputs)
        # and reads every value from the stash.
        placeholder = jax.tree.map(jnp.zeros_like, (weights, h))
        rebuilt, _, _ = BackwardSplit.of(layer, *placeholder, cotangent)
        assert rebuilt.stash_shapes == split.stash_shapes
        full = jax.make_jaxpr(jax.vjp(layer, weights, h)[1])(cotangent).jaxpr
        weights_alone = jax.vjp(lambda w: layer(w, h), weights)[1]
        figures.update(
            full=matmul_flops(full.eqns),
            b=matmul_flops(split.b_eqns),
            w=matmul_flops(split.w_eqns),
            weights_alone=matmul_flops(jax.make_jaxpr(weights_alone)(cotangent).jaxpr.eqns),
        )
        return d_h, rebuilt.weight_grad(stash)

    d_h, d_weights = split_backward(weights, h, cotangent)
    expected_d_weights, expected_d_h = jax.vjp(layer, weights, h)[1](cotangent)
    assert_trees_close((d_h, d_weights), (expected_d_h, expected_d_weights), atol=1e-6)
    assert figures["b"] + figures["w"] == figures["full"], figures
    assert figures["b"] > 0 and figures["w"] > 0, figures
    # The vjp with respect to the weights alone carries the cotangent back again.
    assert figures["weights_alone"] == figures["full"] > figures["w"], figures
    np.testing.assert_array_less(0.3 * figures["full"], figures["w"])


def test_a_stage_split_layer_by_layer_equals_its_vjp(assert_trees_close):
    """A stage of two stacked MoE layers: the forward keeping each layer's residuals, B from
    the last layer to the first, then W from B's stash, give `apply_layers`' vjp."""
    config = registry.tiny_config("qwen_moe")
    layers = models.DecoderLM(config, key=jax.random.key(0)).blocks.layers
    arrays, static = eqx.partition(layers, eqx.is_array)
    weights, data = eqx.partition(arrays, eqx.is_inexact_array)

    def layer_fn(w, d, h):
        return eqx.combine(w, d, static)(h)

    h = jax.random.normal(jax.random.key(1), (2, 8, config.d_model))
    outputs, pullback = jax.vjp(
        lambda w, x: apply_layers(eqx.combine(w, data, static), x), weights, h
    )
    h_grad = jax.random.normal(jax.random.key(2), h.shape)
    # Every layer's aux values get the same cotangent, as a pipeline's aux loss gives them.
    one_aux_grad = jax.tree.map(lambda s: jnp.full(s.shape[1:], 0.1, s.dtype), outputs[1])
    aux_grads = jax.tree.map(lambda g, s: jnp.broadcast_to(g, s.shape), one_aux_grad, outputs[1])
    expected_d_weights, expected_d_h = pullback((h_grad, aux_grads))

    @jax.jit
    def split(weights, h):
        one = jax.tree.map(lambda leaf: leaf[0], (weights, data))
        layout = PullbackResiduals.of(lambda w, x: layer_fn(w, one[1], x), one[0], h)
        (h_out, aux), residuals = stage_forward(layer_fn, layout, weights, data, h)
        d_h, stash = stage_input_grad(
            layer_fn, layout, weights, data, residuals, h_grad, one_aux_grad
        )
        d_weights = stage_weight_grad(layer_fn, weights, data, stash, h_grad, one_aux_grad)
        return (h_out, aux), d_h, d_weights

    (h_out, aux), d_h, d_weights = split(weights, h)
    assert_trees_close((h_out, aux), outputs)
    assert_trees_close((d_h, d_weights), (expected_d_h, expected_d_weights), atol=1e-6)


@pytest.mark.parametrize("remat_stages", [True, False], ids=["remat", "no-remat"])
def test_zero_bubble_does_the_matrix_work_of_1f1b(remat_stages, tiny_config, random_batch):
    """Each action's FLOPs (from the traced branches, `action_flops`) times how often the
    schedule runs it, and the head's once per microbatch: ZB-H1's and ZB-V's B and W together
    do 1F1B's BW, so a step's matrix work is 1F1B's (before the split ZB-H1's W re-ran the
    whole stage vjp: 1.4x)."""
    config = tiny_config("qwen_moe", n_layers=4)
    model = models.DecoderLM(config, key=jax.random.key(0))
    mesh = make_mesh(MeshConfig(pp=2), jax.devices()[:2])
    data = random_batch((4, 2, 8))
    totals = {}
    for name in ("1f1b", "zb_h1", "zb_v"):
        step = StepConfig(
            schedule=Schedule(name, 2, 4, 2 if name == "zb_v" else 1), remat_stages=remat_stages
        )
        schedule = step.schedule  # with an R before each B where the stage is rematerialised

        def loss(model, step=step):
            return pipelined_loss_and_grad(
                model, data["tokens"], data["targets"], config=step, mesh=mesh
            )

        staged = to_pipeline_layout(model, schedule)
        flops = action_flops(jax.make_jaxpr(loss)(staged).jaxpr)
        per_action = {F: flops.forward, B: flops.input_grad, W: flops.weight_grad}
        per_action[BW], per_action[RECOMPUTE] = flops.both, flops.recompute
        actions = np.asarray(schedule.actions().action)
        totals[name] = schedule.microbatches * flops.head + sum(
            (per_action[code] or 0) * int((actions == code).sum()) for code in per_action
        )
    for name in ("zb_h1", "zb_v"):
        assert 0.95 * totals["1f1b"] <= totals[name] <= 1.05 * totals["1f1b"], totals


# Each schedule once, and stage remat with and without, by default (the split B/W on both
# sides: zb_h1 without, zb_v with; 1F1B's fused BW with remat); ``EQXZOO_FULL_GRIDS=1`` runs
# all six.
STASH_CASES = [("1f1b", True), ("zb_h1", False), ("zb_v", True)]
if FULL_GRIDS:
    STASH_CASES += [("1f1b", False), ("zb_h1", True), ("zb_v", False)]
# M = P against M = 4P; zb_v from M = 2P + 1, where its V first streams: at M = P it holds
# all 2P chunks at once, fewer than the 2P + 2 it keeps in flight at any larger M.
STASH_MICROBATCHES = {"1f1b": (2, 8), "zb_h1": (2, 8), "zb_v": (5, 8)}


@pytest.mark.parametrize(
    ("name", "remat_stages"),
    STASH_CASES,
    ids=[f"{name}-{'remat' if remat else 'no-remat'}" for name, remat in STASH_CASES],
)
def test_the_stash_does_not_grow_with_the_microbatches(
    name, remat_stages, tiny_config, random_batch
):
    """The compiled step's temporary bytes at M = 4P are within 10% of a small M (the same
    microbatch): the executor keeps the items in flight (B's stash for W among them), not
    one slot per microbatch. (With its slots sized by M instead, the bound fails.)"""
    config = tiny_config("qwen_moe", n_layers=4)
    model = models.DecoderLM(config, key=jax.random.key(0))
    mesh = make_mesh(MeshConfig(pp=2), jax.devices()[:2])
    temporaries = {}
    for microbatches in STASH_MICROBATCHES[name]:
        schedule = Schedule(name, 2, microbatches, 2 if name == "zb_v" else 1)
        step = StepConfig(schedule=schedule, remat_stages=remat_stages)
        data = random_batch((microbatches, 2, 8))
        compiled = (
            jax.jit(
                lambda model, tokens, targets, step=step: pipelined_loss_and_grad(
                    model, tokens, targets, config=step, mesh=mesh
                )
            )
            .lower(to_pipeline_layout(model, schedule), data["tokens"], data["targets"])
            .compile()
        )
        temporaries[microbatches] = compiled.memory_analysis().temp_size_in_bytes
    few, many = STASH_MICROBATCHES[name]
    assert temporaries[many] <= 1.1 * temporaries[few], temporaries
