"""Row maxima and the softmax over rows in the form XLA:CPU runs fast: the maximum bit for bit
``jnp.max``'s, the softmax `jax.nn.softmax`'s formula and JVP (to float rounding: XLA fuses
the two programs differently).

XLA:CPU, compiling without YNNPACK fusions (`eqxzoo.runtime.FAST_CPU_FLAGS`), rewrites a
reduction over more than 32 elements into a windowed reduction first (for the precision of
sums); for a maximum, which is exact in any order, that only costs time: the
row maximum of the reference model's ``(8, 4, 256, 256)`` attention scores took 1.65 ms, and
0.25 ms folded in halves (`row_max`), the same values bit for bit.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

# XLA:CPU reduces up to this many elements of a row directly.
DIRECT_REDUCTION = 32


def row_max(x: Float[Array, "*rows n"]) -> Float[Array, "*rows"]:
    """``x.max(-1)``: the row folded in halves by elementwise maximum down to
    `DIRECT_REDUCTION` elements (while its width is even), then reduced."""
    while x.shape[-1] > DIRECT_REDUCTION and x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = jnp.maximum(x[..., :half], x[..., half:])
    return x.max(-1)


@jax.custom_jvp
def softmax_rows(x: Float[Array, "*rows n"]) -> Float[Array, "*rows n"]:
    """`jax.nn.softmax` over the last axis (its formula and its JVP), with `row_max`."""
    unnormalized = jnp.exp(x - row_max(x)[..., None])
    return unnormalized / unnormalized.sum(-1, keepdims=True)


@softmax_rows.defjvp
def _softmax_rows_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    y = softmax_rows(x)
    return y, y * (x_dot - (y * x_dot).sum(-1, keepdims=True))
