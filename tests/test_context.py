"""Context-parallel attention (`eqxzoo.nn.context`): a sequence split over a ``cp`` axis of
simulated devices, laid out for causal balance, attends as the whole sequence does on one
device (fp32, values and every gradient), by ring and by all-gather."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from eqxzoo.nn import balanced_order, blockwise_attend, context_attend

SEQ, HEAD_DIM, SHARDS = 32, 8, 4
# (query heads, key/value heads, window, soft-cap, sinks)
OPTIONS = {
    "causal": (4, 4, 0, None, False),
    "gqa-window": (4, 2, 5, None, False),
    "softcap-sinks": (4, 1, 0, 30.0, True),
}


def test_balanced_order_gives_each_shard_a_chunk_and_its_mirror():
    order = balanced_order(16, 4)
    np.testing.assert_array_equal(order.reshape(4, 4)[1], [2, 3, 12, 13])
    assert sorted(order) == list(range(16))
    causal_work = (order.reshape(4, 4) + 1).sum(axis=1)  # keys each shard's queries see
    assert len(set(causal_work)) == 1
    with pytest.raises(ValueError, match="does not split into 2 x 4 equal chunks"):
        balanced_order(12, 4)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_a_sharded_sequence_attends_as_the_whole_one(strategy, options, assert_trees_close):
    n_heads, n_kv_heads, window, softcap, with_sinks = OPTIONS[options]
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (2, SEQ, n_heads, HEAD_DIM))
    k = jax.random.normal(keys[1], (2, SEQ, n_kv_heads, HEAD_DIM))
    v = jax.random.normal(keys[2], (2, SEQ, n_kv_heads, HEAD_DIM))
    d_out = jax.random.normal(keys[3], (2, SEQ, n_heads, HEAD_DIM))
    sinks = jax.random.normal(keys[4], (n_heads,)) if with_sinks else None
    options = dict(window=window, scale=HEAD_DIM**-0.5, softcap=softcap, block_size=4)
    positions = jnp.arange(SEQ)

    def whole(q, k, v, sinks):
        out = blockwise_attend(q, k, v, positions, positions, sinks=sinks, **options)
        return jnp.sum(out * d_out), out

    (_, expected), expected_grads = jax.value_and_grad(whole, argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, sinks
    )

    order = jnp.asarray(balanced_order(SEQ, SHARDS))
    mesh = jax.make_mesh(
        (SHARDS,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:SHARDS]
    )
    by_seq = P(None, "cp")

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(by_seq, by_seq, by_seq, P("cp"), P(), by_seq),
        out_specs=(P(), by_seq),
    )
    def sharded(q, k, v, positions, sinks, d_out):
        out = context_attend(
            q, k, v, positions, axis_name="cp", strategy=strategy, sinks=sinks, **options
        )
        return jax.lax.psum(jnp.sum(out * d_out), "cp"), out

    def laid_out(q, k, v, sinks):
        return sharded(q[:, order], k[:, order], v[:, order], order, sinks, d_out[:, order])

    (_, out), grads = jax.jit(jax.value_and_grad(laid_out, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, sinks
    )
    inverse = jnp.argsort(order)
    np.testing.assert_allclose(out[:, inverse], expected, rtol=1e-5, atol=1e-6)
    assert_trees_close(grads, expected_grads)
