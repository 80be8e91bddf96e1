"""Rotary position embeddings (the rotate-half layout used by Llama, Mixtral and Qwen)."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rope_frequencies(head_dim: int, theta: float) -> Float[Array, " half"]:
    """Inverse frequencies ``theta^(-2i/head_dim)`` for ``i < head_dim / 2``."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return 1.0 / (theta**exponents)


def apply_rope(
    x: Float[Array, "*batch seq heads head_dim"], positions: Int[Array, " seq"], theta: float
) -> Float[Array, "*batch seq heads head_dim"]:
    """Rotate each (i, i + head_dim/2) pair of features by ``position * frequency_i``.

    The angles are computed in float32; the result has the input dtype.
    """
    head_dim = x.shape[-1]
    angles = positions.astype(jnp.float32)[:, None] * rope_frequencies(head_dim, theta)[None, :]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
