"""Pipelined training equals single-device training (fp32, rtol 1e-5), on many meshes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.train.step import (
    StepConfig,
    from_pipeline_layout,
    pipelined_loss,
    sequential_loss,
    to_pipeline_layout,
)

VOCAB = 53
DENSE = models.LlamaConfig(
    vocab_size=VOCAB, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, mlp_dim=48
)
MOE = models.QwenMoeConfig(
    vocab_size=VOCAB,
    d_model=32,
    n_layers=8,
    n_heads=4,
    n_kv_heads=2,
    moe=models.MoEConfig(
        n_experts=4, top_k=2, expert_mlp_dim=16, shared_mlp_dim=16, shared_gate=True
    ),
)


def make_batch(shape, seed=0):
    tokens_key, targets_key = jax.random.split(jax.random.key(seed))
    return {
        "tokens": jax.random.randint(tokens_key, shape, 0, VOCAB),
        "targets": jax.random.randint(targets_key, shape, 0, VOCAB),
    }


def assert_trees_close(actual, expected, rtol=1e-5, atol=0.0):
    """Every leaf equal within rtol of the leaf's own scale (fp32 rounding, not a loose match)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        scale = np.max(np.abs(e))
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol + rtol * scale)


def loss_and_grads(
    model_config, mesh_config, stages, microbatches, repeats, *, batch=4, bubble_fill=0.0
):
    schedule = Schedule("circular" if repeats > 1 else "gpipe", stages, microbatches, repeats)
    config = StepConfig(
        schedule=schedule, bubble_fill=bubble_fill, load_balance_weight=0.1, router_z_weight=0.01
    )
    mesh = make_mesh(mesh_config, jax.devices()[: mesh_config.size])
    model = models.DecoderLM(model_config, key=jax.random.key(0))
    data = make_batch((microbatches, batch, 8))

    def sequential(model):
        return sequential_loss(model, data["tokens"], data["targets"], config=config)

    def pipelined(model):
        return pipelined_loss(model, data["tokens"], data["targets"], config=config, mesh=mesh)

    expected = eqx.filter_jit(eqx.filter_value_and_grad(sequential, has_aux=True))(model)
    staged = to_pipeline_layout(model, schedule)
    (loss, aux), grads = eqx.filter_jit(eqx.filter_value_and_grad(pipelined, has_aux=True))(staged)
    return expected, ((loss, aux), from_pipeline_layout(grads))


GRID = [
    # (model, mesh, P, M, R)
    ("dense", MeshConfig(dp=2, tp=2), 1, 2, 1),
    ("dense", MeshConfig(dp=2, pp=2, tp=2), 2, 2, 1),
    ("dense", MeshConfig(pp=2), 2, 3, 1),
    ("dense", MeshConfig(dp=2, pp=2, tp=2), 2, 4, 2),
    ("dense", MeshConfig(dp=2, pp=4), 4, 4, 1),
    ("dense", MeshConfig(pp=4, tp=2), 4, 5, 2),
    ("dense", MeshConfig(dp=2, pp=4), 4, 8, 2),
    ("dense", MeshConfig(pp=8), 8, 8, 1),
    ("dense", MeshConfig(pp=8), 8, 11, 1),
    ("moe", MeshConfig(dp=2, tp=2, ep=2), 1, 2, 1),
    ("moe", MeshConfig(dp=2, pp=2, ep=2), 2, 2, 1),
    ("moe", MeshConfig(pp=2, tp=2, ep=2), 2, 3, 2),
    ("moe", MeshConfig(pp=4, ep=2), 4, 4, 1),
    ("moe", MeshConfig(pp=4, dp=2), 4, 6, 2),
    ("moe", MeshConfig(pp=8), 8, 16, 1),
]


@pytest.mark.parametrize(
    ("family", "mesh_config", "stages", "microbatches", "repeats"),
    GRID,
    ids=[f"{f}-{m.describe().replace(' x ', ',')}-P{p}-M{mb}-R{r}" for f, m, p, mb, r in GRID],
)
def test_pipelined_loss_and_gradients_equal_sequential(
    family, mesh_config, stages, microbatches, repeats
):
    model_config = DENSE if family == "dense" else MOE
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = loss_and_grads(
        model_config, mesh_config, stages, microbatches, repeats
    )
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    assert_trees_close(pp_aux, aux)
    assert_trees_close(pp_grads, grads)
    if family == "moe":
        assert pp_aux["expert_fraction"].shape == (8, 4)


def test_bubbles_filled_with_nan_change_nothing():
    (loss, aux), grads = loss_and_grads(DENSE, MeshConfig(pp=4), 4, 5, 2)[1]
    (nan_loss, nan_aux), nan_grads = loss_and_grads(
        DENSE, MeshConfig(pp=4), 4, 5, 2, bubble_fill=jnp.nan
    )[1]
    assert np.isfinite(float(nan_loss))
    np.testing.assert_array_equal(nan_loss, loss)
    for a, b in zip(
        jax.tree.leaves((nan_aux, nan_grads)), jax.tree.leaves((aux, grads)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
