"""Pipelined training equals single-device training (fp32, rtol 1e-5), on many meshes."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.train.layout import from_pipeline_layout, to_pipeline_layout
from eqxzoo.train.loss import pipelined_loss, pipelined_loss_and_grad, sequential_loss
from eqxzoo.train.settings import StepConfig

N_LAYERS = 8


def without_padding(aux: dict) -> dict:
    return {name: value for name, value in aux.items() if name != "padding_fraction"}


@pytest.fixture
def loss_and_grads(tiny_config, random_batch):
    """``(sequential (loss, aux), grads), (pipelined (loss, aux), grads)`` of a tiny model.

    The aux values leave out ``padding_fraction``: it describes how the dropless path ran
    (the sequential reference routes each sequence alone, a pipeline stage its whole
    microbatch at once), not what the model computes."""

    def compute(
        family,
        mesh_config,
        stages,
        microbatches,
        repeats,
        *,
        batch=4,
        bubble_fill=0.0,
        name=None,
        remat_stages=True,
        skip_bubbles=True,
        loss_chunk_size=StepConfig.loss_chunk_size,
        z_loss_weight=0.0,
        model_overrides=None,
    ):
        name = name or ("circular" if repeats > 1 else "gpipe")
        schedule = Schedule(name, stages, microbatches, repeats)
        config = StepConfig(
            schedule=schedule,
            bubble_fill=bubble_fill,
            load_balance_weight=0.1,
            router_z_weight=0.01,
            remat_stages=remat_stages,
            skip_bubbles=skip_bubbles,
            loss_chunk_size=loss_chunk_size,
            z_loss_weight=z_loss_weight,
        )
        mesh = make_mesh(mesh_config, jax.devices()[: mesh_config.size])
        model_config = tiny_config(family, n_layers=N_LAYERS)
        model_config = dataclasses.replace(model_config, **(model_overrides or {}))
        model = models.DecoderLM(model_config, key=jax.random.key(0))
        data = random_batch((microbatches, batch, 8))

        def sequential(model):
            return sequential_loss(model, data["tokens"], data["targets"], config=config)

        def pipelined(model):
            return pipelined_loss(model, data["tokens"], data["targets"], config=config, mesh=mesh)

        def fused(model):
            return pipelined_loss_and_grad(
                model, data["tokens"], data["targets"], config=config, mesh=mesh
            )

        value_and_grad = functools.partial(eqx.filter_value_and_grad, has_aux=True)
        (expected_loss, expected_aux), expected_grads = eqx.filter_jit(value_and_grad(sequential))(
            model
        )
        staged = to_pipeline_layout(model, schedule)
        pipelined_value_and_grad = fused if schedule.fuses_backward else value_and_grad(pipelined)
        (loss, aux), grads = eqx.filter_jit(pipelined_value_and_grad)(staged)
        return (
            ((expected_loss, without_padding(expected_aux)), expected_grads),
            ((loss, without_padding(aux)), from_pipeline_layout(grads)),
        )

    return compute


GRID = [
    # (model, mesh, P, M, R)
    ("llama", MeshConfig(dp=2, tp=2), 1, 2, 1),
    ("llama", MeshConfig(dp=2, pp=2, tp=2), 2, 2, 1),
    ("llama", MeshConfig(pp=2), 2, 3, 1),
    ("llama", MeshConfig(dp=2, pp=2, tp=2), 2, 4, 2),
    ("llama", MeshConfig(dp=2, pp=4), 4, 4, 1),
    ("llama", MeshConfig(pp=4, tp=2), 4, 5, 2),
    ("llama", MeshConfig(dp=2, pp=4), 4, 8, 2),
    ("llama", MeshConfig(pp=8), 8, 8, 1),
    ("llama", MeshConfig(pp=8), 8, 11, 1),
    ("qwen_moe", MeshConfig(dp=2, tp=2, ep=2), 1, 2, 1),
    ("qwen_moe", MeshConfig(dp=2, pp=2, ep=2), 2, 2, 1),
    ("qwen_moe", MeshConfig(pp=2, tp=2, ep=2), 2, 3, 2),
    ("qwen_moe", MeshConfig(pp=4, ep=2), 4, 4, 1),
    ("qwen_moe", MeshConfig(pp=4, dp=2), 4, 6, 2),
    ("qwen_moe", MeshConfig(pp=8), 8, 16, 1),
    # Second-wave families: per-layer windows (integer data staged with the weights) and
    # Qwen3-MoE's experts, on dp x pp x tp.
    ("gemma2", MeshConfig(dp=2, pp=2, tp=2), 2, 3, 1),
    ("gemma2", MeshConfig(dp=2, pp=2, tp=2), 2, 4, 2),
    ("qwen3_moe", MeshConfig(dp=2, pp=2, tp=2), 2, 3, 1),
    ("qwen3_moe", MeshConfig(dp=2, pp=2, tp=2), 2, 2, 2),
]


# Every other family once, GPipe on dp x pp x tp: what each adds to the builder (windows,
# post-norms, QK-norm, clipped q/k/v, learned positions, attention sinks, biased experts)
# goes through the pipeline too.
GRID += [
    (family, MeshConfig(dp=2, pp=2, tp=2), 2, 3, 1)
    for family in ("mistral", "qwen3", "gemma3", "olmo2", "olmoe", "gpt2", "gpt_oss")
]

# DeepSeek-V3's shape: a dense prefix layer run before the pipeline (its microbatches split
# over pp where they divide: M = 4), latent attention, sigmoid group-limited routing.
GRID += [
    ("deepseek_v3", MeshConfig(dp=2, pp=2, ep=2), 2, 4, 1),
    ("deepseek_v3", MeshConfig(pp=2, tp=2, ep=2), 2, 3, 2),
]


@pytest.mark.parametrize(
    ("family", "mesh_config", "stages", "microbatches", "repeats"),
    GRID,
    ids=[f"{f}-{m.describe().replace(' x ', ',')}-P{p}-M{mb}-R{r}" for f, m, p, mb, r in GRID],
)
def test_pipelined_loss_and_gradients_equal_sequential(
    family, mesh_config, stages, microbatches, repeats, loss_and_grads, assert_trees_close
):
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = loss_and_grads(
        family, mesh_config, stages, microbatches, repeats
    )
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    assert_trees_close(pp_aux, aux)
    if family == "gpt2":
        grads, pp_grads = (without_key_bias_gradient(g) for g in (grads, pp_grads))
    assert_trees_close(pp_grads, grads)
    if family == "qwen_moe":
        assert pp_aux["expert_fraction"].shape == (8, 4)
    if family == "gemma2":  # the windows were staged with their layers
        assert pp_grads.blocks.layers.attention.window is None


def without_key_bias_gradient(grads):
    """``grads`` with the key bias's gradient checked to be zero and removed.

    Without rotary embeddings (GPT-2) the key bias adds the same ``q . b_k`` to every score of
    a query, which the softmax ignores: its gradient is zero in exact arithmetic and rounding
    noise (~1e-12) in floats, which no relative tolerance can compare.
    """
    attention = grads.blocks.layers.attention
    scale = np.max(np.abs(np.asarray(attention.wk)))
    assert np.max(np.abs(np.asarray(attention.bk))) < 1e-6 * scale
    return eqx.tree_at(lambda g: g.blocks.layers.attention.bk, grads, None)


def test_bubbles_filled_with_nan_change_nothing(loss_and_grads):
    (loss, aux), grads = loss_and_grads("llama", MeshConfig(pp=4), 4, 5, 2)[1]
    (nan_loss, nan_aux), nan_grads = loss_and_grads(
        "llama", MeshConfig(pp=4), 4, 5, 2, bubble_fill=jnp.nan
    )[1]
    assert np.isfinite(float(nan_loss))
    np.testing.assert_array_equal(nan_loss, loss)
    for a, b in zip(
        jax.tree.leaves((nan_aux, nan_grads)), jax.tree.leaves((aux, grads)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", ["qwen_moe", "deepseek_v3"])
def test_stages_computing_through_bubbles_equal_sequential(
    family, loss_and_grads, assert_trees_close
):
    """Without the bubble-skipping branch (XLA:CPU's way around collective-permutes in the
    stage), bubbles compute on zeros and are dropped: NaN bubbles leak into nothing."""
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = loss_and_grads(
        family, MeshConfig(dp=2, pp=2, ep=2), 2, 3, 2, bubble_fill=jnp.nan, skip_bubbles=False
    )
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    assert_trees_close(pp_aux, aux)
    assert_trees_close(pp_grads, grads)


# The 1F1B family, run by the forward-and-backward executor: (schedule, model, mesh, P, M, R),
# M in {P, 2P + 1, 4P}, with data, tensor and expert parallelism mixed in, dense and MoE.
FUSED_GRID = [
    ("1f1b", "llama", MeshConfig(dp=2, pp=2, tp=2), 2, 2, 1),
    ("1f1b", "qwen_moe", MeshConfig(pp=2, tp=2, ep=2), 2, 5, 1),
    ("1f1b", "llama", MeshConfig(dp=2, pp=4), 4, 16, 1),
    ("1f1b", "qwen_moe", MeshConfig(pp=8), 8, 8, 1),
    ("zb_h1", "llama", MeshConfig(pp=2, tp=2), 2, 8, 1),
    ("zb_h1", "qwen_moe", MeshConfig(dp=2, pp=2, ep=2), 2, 5, 1),
    ("zb_h1", "qwen_moe", MeshConfig(pp=4, tp=2), 4, 9, 1),
    ("zb_h1", "llama", MeshConfig(pp=8), 8, 17, 1),
    ("interleaved_1f1b", "llama", MeshConfig(dp=2, pp=2, tp=2), 2, 2, 2),
    ("interleaved_1f1b", "qwen_moe", MeshConfig(pp=2, ep=2), 2, 5, 2),
    ("interleaved_1f1b", "qwen_moe", MeshConfig(pp=4, dp=2), 4, 4, 2),
    ("interleaved_1f1b", "llama", MeshConfig(pp=4, tp=2), 4, 9, 2),
    ("zb_h1", "gemma2", MeshConfig(dp=2, pp=2, tp=2), 2, 5, 1),
    ("interleaved_1f1b", "gemma2", MeshConfig(pp=2, tp=2), 2, 4, 2),
    ("1f1b", "deepseek_v3", MeshConfig(dp=2, pp=2, ep=2), 2, 4, 1),
    ("zb_h1", "deepseek_v3", MeshConfig(pp=2, tp=2, ep=2), 2, 5, 1),
]


@pytest.mark.parametrize(
    ("name", "family", "mesh_config", "stages", "microbatches", "repeats"),
    FUSED_GRID,
    ids=[
        f"{n}-{f}-{m.describe().replace(' x ', ',')}-P{p}-M{mb}-R{r}"
        for n, f, m, p, mb, r in FUSED_GRID
    ],
)
def test_1f1b_family_loss_and_gradients_equal_sequential(
    name, family, mesh_config, stages, microbatches, repeats, loss_and_grads, assert_trees_close
):
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = loss_and_grads(
        family, mesh_config, stages, microbatches, repeats, name=name
    )
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    assert_trees_close(pp_aux, aux)
    assert_trees_close(pp_grads, grads)


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "interleaved_1f1b"])
def test_1f1b_family_without_stage_remat_stashes_residuals_exactly(
    name, loss_and_grads, assert_trees_close
):
    repeats = 2 if name == "interleaved_1f1b" else 1
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = loss_and_grads(
        "qwen_moe", MeshConfig(dp=2, pp=2, tp=2), 2, 5, repeats, name=name, remat_stages=False
    )
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    assert_trees_close(pp_aux, aux)
    assert_trees_close(pp_grads, grads)


def test_idle_ticks_sending_nan_change_nothing_in_the_1f1b_family(loss_and_grads):
    for name, repeats in (("zb_h1", 1), ("interleaved_1f1b", 2)):
        args = ("qwen_moe", MeshConfig(pp=4), 4, 5, repeats)
        (loss, aux), grads = loss_and_grads(*args, name=name)[1]
        (nan_loss, nan_aux), nan_grads = loss_and_grads(*args, name=name, bubble_fill=jnp.nan)[1]
        assert np.isfinite(float(nan_loss))
        np.testing.assert_array_equal(nan_loss, loss)
        for a, b in zip(
            jax.tree.leaves((nan_aux, nan_grads)), jax.tree.leaves((aux, grads)), strict=True
        ):
            np.testing.assert_array_equal(a, b)


# The fused loss over several vocabulary chunks (64 = 4 x 16), with the z-loss, against the
# plain loss of the sequential reference: Gemma 2's tied embeddings and final soft-cap, and
# a 1F1B-family schedule, whose last stage computes the loss inside the pipeline.
CHUNKED_LOSS_GRID = [
    ("gpipe", "gemma2", MeshConfig(dp=2, pp=2, tp=2), 2, 3, 1),
    ("zb_h1", "llama", MeshConfig(dp=2, pp=2, tp=2), 2, 4, 1),
]


@pytest.mark.parametrize(
    ("name", "family", "mesh_config", "stages", "microbatches", "repeats"),
    CHUNKED_LOSS_GRID,
    ids=[f"{n}-{f}" for n, f, *_ in CHUNKED_LOSS_GRID],
)
def test_chunked_loss_with_z_loss_equals_the_plain_loss(
    name, family, mesh_config, stages, microbatches, repeats, loss_and_grads, assert_trees_close
):
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = loss_and_grads(
        family,
        mesh_config,
        stages,
        microbatches,
        repeats,
        name=name,
        loss_chunk_size=16,
        z_loss_weight=0.01,
        model_overrides={"vocab_size": 64},
    )
    assert aux["z_loss"] > 1.0  # the log-sum-exp of 64 logits near zero is ~log(64)
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    np.testing.assert_allclose(loss, aux["cross_entropy"] + 0.01 * aux["z_loss"], rtol=1e-6)
    assert_trees_close(pp_aux, aux)
    assert_trees_close(pp_grads, grads)


# The blockwise attention kernel inside the stages (a custom VJP whose loops run in the
# region manual over pp), in blocks of 3 over 8 tokens: windows, sinks, latent attention.
BLOCKWISE_GRID = [
    ("gpipe", "gemma2", MeshConfig(dp=2, pp=2, tp=2), 2, 3, 1),
    ("zb_h1", "gpt_oss", MeshConfig(pp=2, tp=2, ep=2), 2, 4, 1),
    ("circular", "deepseek_v3", MeshConfig(pp=2, tp=2, ep=2), 2, 3, 2),
]


@pytest.mark.parametrize(
    ("name", "family", "mesh_config", "stages", "microbatches", "repeats"),
    BLOCKWISE_GRID,
    ids=[f"{n}-{f}" for n, f, *_ in BLOCKWISE_GRID],
)
def test_blockwise_attention_in_the_stages_equals_sequential(
    name, family, mesh_config, stages, microbatches, repeats, loss_and_grads, assert_trees_close
):
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = loss_and_grads(
        family,
        mesh_config,
        stages,
        microbatches,
        repeats,
        name=name,
        model_overrides={"attention_kernel": "blockwise", "attention_block_size": 3},
    )
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    assert_trees_close(pp_aux, aux)
    assert_trees_close(pp_grads, grads)
