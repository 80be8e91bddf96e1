"""grouped_matmul: equal to a gather-per-row reference under grad, jit and (nested) vmap."""

import jax
import jax.numpy as jnp
import numpy as np

from eqxzoo.nn import grouped_matmul

GROUP_SIZES = jnp.array([[3, 5, 2], [0, 7, 3]], jnp.int32)


def reference(x, w, group_sizes):
    group = jnp.sum(jnp.arange(x.shape[0])[None, :] >= jnp.cumsum(group_sizes)[:, None], axis=0)
    return jnp.einsum("mk,mkn->mn", x, w[group])


def _inputs():
    kx, kw, kb = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(kx, (2, 10, 4)),
        jax.random.normal(kw, (3, 4, 5)),
        jax.random.normal(kb, (2, 3, 4, 5)),
    )


def _close(a, b):
    jax.tree.map(lambda p, q: np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-5), a, b)


def _sin_sum(f, in_axes):
    return lambda x, w: jnp.sum(jnp.sin(jax.vmap(f, in_axes)(x, w, GROUP_SIZES)))


def test_unbatched_forward_and_gradient():
    x, w, _ = _inputs()

    def loss(f):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w, GROUP_SIZES[1]))), (0, 1)))

    _close(grouped_matmul(x[1], w, GROUP_SIZES[1]), reference(x[1], w, GROUP_SIZES[1]))
    _close(loss(grouped_matmul)(x[1], w), loss(reference)(x[1], w))


def test_vmap_with_shared_weights_forward_and_gradient():
    x, w, _ = _inputs()
    in_axes = (0, None, 0)
    _close(
        jax.vmap(grouped_matmul, in_axes)(x, w, GROUP_SIZES),
        jax.vmap(reference, in_axes)(x, w, GROUP_SIZES),
    )
    _close(
        jax.grad(_sin_sum(grouped_matmul, in_axes), (0, 1))(x, w),
        jax.grad(_sin_sum(reference, in_axes), (0, 1))(x, w),
    )


def test_vmap_with_batched_weights_forward_and_gradient():
    x, _, w_batched = _inputs()
    _close(
        jax.grad(_sin_sum(grouped_matmul, 0), (0, 1))(x, w_batched),
        jax.grad(_sin_sum(reference, 0), (0, 1))(x, w_batched),
    )


def test_nested_vmap():
    x, w, _ = _inputs()
    xs, sizes = jnp.stack([x, 2 * x]), jnp.stack([GROUP_SIZES, GROUP_SIZES[::-1]])

    def loss(f):
        nested = jax.vmap(jax.vmap(f, (0, None, 0)), (0, None, 0))
        return lambda w: jnp.sum(jnp.sin(nested(xs, w, sizes)))

    _close(jax.grad(loss(grouped_matmul))(w), jax.grad(loss(reference))(w))
