"""Grouped matrix multiplication (`jax.lax.ragged_dot`) that is safe under `jax.vmap`.

``grouped_matmul(x, w, group_sizes)`` multiplies the rows of ``x`` (sorted by group) by their
group's matrix. `jax.lax.ragged_dot` only batches when every operand is batched on axis 0,
so ``jax.vmap`` of a model whose weights are shared across the batch fails. Here the
batching rules regroup instead: with shared weights, the rows of every batch element are
sorted into one global grouping (one grouped matmul for the whole batch, the efficient thing
anyway); with per-element weights or weight gradients, the ``(batch, group)`` pairs become the
groups. The rules live in `jax.custom_batching.custom_vmap` primitives, which JAX cannot
differentiate, so differentiation is a `jax.custom_vjp` around them whose forward and backward
passes are themselves grouped matmuls.
"""

import jax
import jax.numpy as jnp
from jax import custom_batching
from jaxtyping import Array, Float, Int

_WEIGHT_GRAD_DIMENSIONS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def _broadcast_batch(value, batched: bool, axis_size: int):
    return value if batched else jnp.broadcast_to(value, (axis_size, *value.shape))


def _group_of_rows(
    group_sizes: Int[Array, "*batch groups"], n_rows: int
) -> Int[Array, "*batch rows"]:
    ends = jnp.cumsum(group_sizes, axis=-1)
    rows = jnp.arange(n_rows)
    return jnp.sum(rows[..., None, :] >= ends[..., :, None], axis=-2)


@custom_batching.custom_vmap
def _rows_times_groups(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes)


@_rows_times_groups.def_vmap
def _rows_times_groups_batched(axis_size, in_batched, x, w, group_sizes):
    x_batched, w_batched, sizes_batched = in_batched
    x = _broadcast_batch(x, x_batched, axis_size)
    n_rows, n_groups = x.shape[1], w.shape[-3]
    group_sizes = _broadcast_batch(group_sizes, sizes_batched, axis_size)
    flat_x = x.reshape(axis_size * n_rows, x.shape[-1])
    if w_batched:
        flat_w = w.reshape(axis_size * n_groups, *w.shape[-2:])
        out = _rows_times_groups(flat_x, flat_w, group_sizes.reshape(-1))
        return out.reshape(axis_size, n_rows, -1), True
    row_groups = _group_of_rows(group_sizes, n_rows).reshape(-1)
    order = jnp.argsort(row_groups, stable=True)
    sorted_out = _rows_times_groups(flat_x[order], w, jnp.sum(group_sizes, axis=0))
    out = jnp.zeros_like(sorted_out).at[order].set(sorted_out)
    return out.reshape(axis_size, n_rows, -1), True


@custom_batching.custom_vmap
def _weight_gradient(x, dy, group_sizes):
    return jax.lax.ragged_dot_general(x, dy, group_sizes, _WEIGHT_GRAD_DIMENSIONS)


@_weight_gradient.def_vmap
def _weight_gradient_batched(axis_size, in_batched, x, dy, group_sizes):
    x = _broadcast_batch(x, in_batched[0], axis_size)
    dy = _broadcast_batch(dy, in_batched[1], axis_size)
    group_sizes = _broadcast_batch(group_sizes, in_batched[2], axis_size)
    n_rows, n_groups = x.shape[1], group_sizes.shape[-1]
    flat = _weight_gradient(
        x.reshape(axis_size * n_rows, -1),
        dy.reshape(axis_size * n_rows, -1),
        group_sizes.reshape(-1),
    )
    return flat.reshape(axis_size, n_groups, *flat.shape[1:]), True


@jax.custom_vjp
def grouped_matmul(
    x: Float[Array, "rows in_features"],
    w: Float[Array, "groups in_features out_features"],
    group_sizes: Int[Array, " groups"],
) -> Float[Array, "rows out_features"]:
    """``out[r] = x[r] @ w[g(r)]`` where rows are sorted by group, ``group_sizes[g]`` per group.

    Rows past ``sum(group_sizes)`` give zeros. Differentiable and batchable in any order.
    """
    return _rows_times_groups(x, w, group_sizes)


def _grouped_matmul_forward(x, w, group_sizes):
    return _rows_times_groups(x, w, group_sizes), (x, w, group_sizes)


def _grouped_matmul_backward(residuals, dy):
    x, w, group_sizes = residuals
    dx = _rows_times_groups(dy, jnp.swapaxes(w, -1, -2), group_sizes)
    dw = _weight_gradient(x, dy, group_sizes).astype(w.dtype)
    group_sizes_cotangent = jnp.zeros(group_sizes.shape, jax.dtypes.float0)
    return dx.astype(x.dtype), dw, group_sizes_cotangent


grouped_matmul.defvjp(_grouped_matmul_forward, _grouped_matmul_backward)
