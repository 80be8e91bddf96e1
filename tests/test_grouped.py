"""grouped_matmul, both implementations (block-sparse loop, `jax.lax.ragged_dot`): equal to a
row-by-row gather reference and to a dense masked reference, forward and backward, under
jit, (nested) vmap, bfloat16 and expert-sharded weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from eqxzoo.nn import grouped_matmul
from eqxzoo.nn.grouped import block_rows, padding_fraction, resolve_implementation

IMPLEMENTATIONS = ["blocks", "ragged_dot"]
# 40 rows in 3 groups: blocks of 16 rows (block_rows(40, 3)).
CASES = {
    "empty_group_and_rows_past_the_sum": [13, 0, 20],
    "all_rows_in_one_group": [40, 0, 0],
    "all_rows_in_the_last_group": [0, 0, 40],
    "sizes_not_multiples_of_the_block": [17, 5, 18],
    "sizes_multiples_of_the_block": [16, 16, 8],
    "most_rows_past_the_sum": [3, 4, 5],
    "no_rows_in_any_group": [0, 0, 0],
}


def group_of_rows(n_rows, group_sizes):
    """Each row's group; ``groups`` for rows past ``sum(group_sizes)``."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(n_rows), side="right")


def gather_reference(x, w, group_sizes):
    """``x[r] @ w[g(r)]`` row by row (a gather of each row's matrix); zero past the sum."""
    group = group_of_rows(x.shape[0], group_sizes)
    rows = jnp.einsum("rk,rkn->rn", x, w[jnp.minimum(group, w.shape[0] - 1)])
    return jnp.where((group < w.shape[0])[:, None], rows, 0.0)


def dense_reference(x, w, group_sizes):
    """Every group's matrix on every row, masked by the rows' one-hot groups."""
    one_hot = jax.nn.one_hot(group_of_rows(x.shape[0], group_sizes), w.shape[0])
    return jnp.einsum("rg,rk,gkn->rn", one_hot, x, w)


def _inputs(n_rows=40, n_groups=3, dtype=jnp.float32):
    kx, kw, kb = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(kx, (n_rows, 8), dtype),
        jax.random.normal(kw, (n_groups, 8, 5), dtype),
        jax.random.normal(kb, (2, n_groups, 8, 5), dtype),
    )


def _close(a, b, tolerance=1e-5):
    jax.tree.map(
        lambda p, q: np.testing.assert_allclose(p, q, rtol=tolerance, atol=tolerance), a, b
    )


@jax.jit(static_argnums=0)
def _value_and_grads(f, x, w, group_sizes):
    """``f``'s output and the gradients of a loss that weighs every output differently."""
    weights = jnp.cos(jnp.arange(x.shape[0] * w.shape[-1])).reshape(x.shape[0], -1)
    return f(x, w, group_sizes), jax.grad(
        lambda x, w: jnp.sum(jnp.sin(f(x, w, group_sizes)) * weights), (0, 1)
    )(x, w)


def _implementation(name):
    return lambda x, w, group_sizes: grouped_matmul(x, w, group_sizes, implementation=name)


IMPLEMENTED = {name: _implementation(name) for name in IMPLEMENTATIONS}


def test_block_size_and_padding_fraction():
    assert block_rows(4096, 8) == 256 and block_rows(4096, 64) == 32
    assert block_rows(40, 3) == 16 and block_rows(5, 3) == 5
    # Blocks of 16: 1 + 0 + 2 + 1 blocks = 64 rows computed for 21 assigned.
    sizes = jnp.array([3, 0, 17, 1], jnp.int32)
    np.testing.assert_allclose(padding_fraction(sizes, 24, implementation="blocks"), 43 / 64)
    # ragged_dot: native on GPU; XLA:CPU multiplies every row by all 4 groups' matrices.
    expected = 0.0 if jax.default_backend() == "gpu" else 0.75
    assert float(padding_fraction(sizes, 24, implementation="ragged_dot")) == expected
    zero = jnp.zeros(4, jnp.int32)
    assert float(padding_fraction(zero, 24, implementation="blocks")) == 0.0


def test_implementation_choice():
    native = jax.default_backend() == "gpu"
    assert resolve_implementation("auto") == ("ragged_dot" if native else "blocks")
    assert resolve_implementation("ragged_dot") == "ragged_dot"
    with pytest.raises((ValueError, TypeError), match="dense"):
        resolve_implementation("dense")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_equal_references(implementation, case):
    x, w, _ = _inputs()
    sizes = jnp.array(CASES[case], jnp.int32)
    expected = _value_and_grads(gather_reference, x, w, sizes)
    _close(_value_and_grads(IMPLEMENTED[implementation], x, w, sizes), expected)
    _close(dense_reference(x, w, sizes), expected[0])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_many_blocks_per_group(implementation):
    """300 rows in 4 groups: blocks of 32, so every group spans several blocks."""
    x, w, _ = _inputs(n_rows=300, n_groups=4)
    sizes = jnp.array([97, 64, 0, 131], jnp.int32)
    assert block_rows(300, 4) == 32
    _close(
        _value_and_grads(IMPLEMENTED[implementation], x, w, sizes),
        _value_and_grads(gather_reference, x, w, sizes),
        1e-4,
    )


def _sin_sum(f, in_axes, group_sizes):
    return lambda x, w: jnp.sum(jnp.sin(jax.vmap(f, in_axes)(x, w, group_sizes)))


# Per element: rows past its sum, an empty group, a group spanning two 16-row blocks.
BATCH_SIZES = jnp.array([[13, 0, 20], [17, 5, 18]], jnp.int32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_with_shared_weights_forward_and_gradient(implementation):
    x, w, _ = _inputs()
    xs, in_axes, f = jnp.stack([x, -x]), (0, None, 0), _implementation(implementation)
    _close(
        jax.jit(jax.vmap(f, in_axes))(xs, w, BATCH_SIZES),
        jax.vmap(gather_reference, in_axes)(xs, w, BATCH_SIZES),
    )
    _close(
        jax.jit(jax.grad(_sin_sum(f, in_axes, BATCH_SIZES), (0, 1)))(xs, w),
        jax.grad(_sin_sum(gather_reference, in_axes, BATCH_SIZES), (0, 1))(xs, w),
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_with_batched_weights_forward_and_gradient(implementation):
    x, _, w_batched = _inputs()
    xs, f = jnp.stack([x, -x]), _implementation(implementation)
    _close(
        jax.jit(jax.vmap(f))(xs, w_batched, BATCH_SIZES),
        jax.vmap(gather_reference)(xs, w_batched, BATCH_SIZES),
    )
    _close(
        jax.jit(jax.grad(_sin_sum(f, 0, BATCH_SIZES), (0, 1)))(xs, w_batched),
        jax.grad(_sin_sum(gather_reference, 0, BATCH_SIZES), (0, 1))(xs, w_batched),
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_per_example_weight_gradients(implementation):
    """vmap of grad: each element's weight gradient from its own rows only."""
    x, w, _ = _inputs()
    xs, f = jnp.stack([x, -x]), _implementation(implementation)

    def per_example(f):
        return jax.vmap(jax.grad(lambda w, x, s: jnp.sum(jnp.sin(f(x, w, s)))), (None, 0, 0))

    _close(
        jax.jit(per_example(f))(w, xs, BATCH_SIZES),
        per_example(gather_reference)(w, xs, BATCH_SIZES),
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nested_vmap(implementation):
    x, w, _ = _inputs(n_rows=10)
    xs = jnp.stack([x.reshape(2, 5, 8), 2 * x.reshape(2, 5, 8)])
    sizes = jnp.array([[[2, 0, 3], [1, 1, 1]], [[0, 5, 0], [4, 0, 0]]], jnp.int32)

    def loss(f):
        nested = jax.vmap(jax.vmap(f, (0, None, 0)), (0, None, 0))
        return lambda w: jnp.sum(jnp.sin(nested(xs, w, sizes)))

    _close(
        jax.jit(jax.grad(loss(_implementation(implementation))))(w),
        jax.grad(loss(gather_reference))(w),
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bfloat16_accumulates_in_float32(implementation):
    x, w, _ = _inputs(n_rows=300, n_groups=4, dtype=jnp.bfloat16)
    sizes = jnp.array([97, 64, 0, 131], jnp.int32)
    out, (dx, dw) = _value_and_grads(IMPLEMENTED[implementation], x, w, sizes)
    assert out.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    up = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)  # noqa: E731
    expected = _value_and_grads(gather_reference, *up((x, w)), sizes)
    _close(up((out, (dx, dw))), expected, 5e-2)


def test_weights_sharded_over_experts():
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    x, _, _ = _inputs(n_rows=300, n_groups=4)
    w = jax.random.normal(jax.random.key(3), (4, 8, 5))
    sizes = jnp.array([97, 64, 0, 131], jnp.int32)
    sharded = jax.device_put(w, NamedSharding(mesh, PartitionSpec("ep")))
    got = _value_and_grads(grouped_matmul, x, sharded, sizes)
    _close(got, _value_and_grads(gather_reference, x, w, sizes), 1e-4)
