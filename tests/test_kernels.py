"""The attention kernels behind `eqxzoo.nn.attend`: which one ``"auto"`` picks, what cuDNN is
refused for, and every family computing the same with the blockwise kernel as with the dense
one (logits and gradients at rtol 1e-5 in fp32)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grids import slow_except

import models
from eqxzoo.errors import ConfigError
from eqxzoo.nn.kernels import choose_kernel, cudnn_attend, dense_attend

SUPPORTED = dict(
    windowed=False, softcap=None, sinks=False, same_head_dims=True, positions_are_indices=True
)


@pytest.mark.parametrize(
    ("platform", "dtype", "kv_seq", "options", "expected"),
    [
        ("cpu", jnp.bfloat16, 4096, SUPPORTED, "blockwise"),
        ("cpu", jnp.float32, 256, SUPPORTED, "dense"),
        ("gpu", jnp.bfloat16, 4096, SUPPORTED, "cudnn"),
        ("gpu", jnp.float32, 4096, SUPPORTED, "blockwise"),
        ("gpu", jnp.bfloat16, 4096, {**SUPPORTED, "sinks": True}, "blockwise"),
        ("gpu", jnp.bfloat16, 4096, {**SUPPORTED, "positions_are_indices": False}, "blockwise"),
        ("tpu", jnp.bfloat16, 4096, SUPPORTED, "blockwise"),
    ],
)
def test_auto_picks_cudnn_on_a_gpu_where_it_computes_the_layer(
    platform, dtype, kv_seq, options, expected
):
    kernel = choose_kernel(
        "auto", dtype=dtype, kv_seq=kv_seq, block_size=512, platform=platform, **options
    )
    assert kernel == expected


def test_an_explicit_kernel_is_kept_and_cudnn_refused_where_it_cannot_compute():
    common = dict(dtype=jnp.bfloat16, kv_seq=64, block_size=512, platform="cpu")
    assert choose_kernel("blockwise", **common, **SUPPORTED) == "blockwise"
    assert choose_kernel("cudnn", **common, **SUPPORTED) == "cudnn"
    with pytest.raises(ValueError, match="cannot compute this attention: it has no a logit"):
        choose_kernel("cudnn", **common, **{**SUPPORTED, "softcap": 30.0})
    with pytest.raises(ValueError, match="it takes bfloat16 or float16, not float32"):
        choose_kernel("cudnn", **{**common, "dtype": jnp.float32}, **SUPPORTED)


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ("gemma2", "it has no a sliding window that is per-layer data, a logit soft-cap"),
        ("gpt_oss", "attention sinks"),
        ("deepseek_v3", "value heads of another size than query heads"),
    ],
)
def test_config_refuses_cudnn_for_attention_it_cannot_compute(tiny_config, family, message):
    with pytest.raises(ConfigError, match=f"^attention_kernel: 'cudnn' cannot compute .*{message}"):
        dataclasses.replace(tiny_config(family, n_layers=2), attention_kernel="cudnn")


def test_cudnn_argument_mapping_equals_dense_attention():
    """`cudnn_attend`'s call of `jax.nn.dot_product_attention` (layouts, grouped heads, batch
    axes, scale), computed by its XLA implementation: on a GPU the same call runs cuDNN."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 3, 10, 4, 8))
    k, v = (jax.random.normal(key, (2, 3, 10, 2, 8)) for key in keys[1:])
    positions = jnp.arange(10)
    expected = dense_attend(q, k, v, positions, positions, scale=0.3)
    got = cudnn_attend(q, k, v, scale=0.3, implementation="xla")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


SEQ = 13  # not a multiple of the block: the kernel pads


@pytest.mark.parametrize(
    "family", slow_except(["gemma2", "gpt_oss", "deepseek_v3"], lambda family: family == "gemma2")
)
def test_blockwise_kernel_computes_every_family_like_the_dense_one(
    tiny_config, random_batch, assert_trees_close, family
):
    """Windows (per-layer data, traced in the layer scan), soft-caps, sinks, GQA and latent
    attention through the whole model, in blocks of 4 so that most blocks are skipped."""
    config = tiny_config(family, n_layers=2)
    tokens = random_batch((2, SEQ))["tokens"]

    def loss_and_grads(kernel):
        model = models.DecoderLM(
            dataclasses.replace(config, attention_kernel=kernel, attention_block_size=4),
            key=jax.random.key(0),
        )

        def loss(model):
            logits, _ = jax.vmap(model)(tokens)
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), logits

        return eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(model)

    (dense_loss, dense_logits), dense_grads = loss_and_grads("dense")
    (loss, logits), grads = loss_and_grads("blockwise")
    np.testing.assert_allclose(logits, dense_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, dense_loss, rtol=1e-5)
    assert_trees_close(grads, dense_grads, atol=1e-7)
