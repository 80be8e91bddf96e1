"""`collective_traffic` against programs whose collectives are known: counts and bytes,
loops multiplied by their trip counts, the costlier branch of a conditional."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from eqxzoo.parallel.collectives import Traffic, collective_traffic, traffic_table


def _mesh():
    return jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])


def _compiled_text(body, *args):
    mapped = jax.shard_map(body, mesh=_mesh(), in_specs=P("x"), out_specs=P("x"))
    return jax.jit(mapped).lower(*args).compile().as_text()


def test_a_psum_in_a_loop_counts_once_per_iteration():
    def body(v):
        def step(carry, _):
            return jax.lax.psum(carry, "x") * 0.5 + carry, None

        return jax.lax.scan(step, v, None, length=3)[0]

    traffic = collective_traffic(_compiled_text(body, jnp.ones((2, 256), jnp.float32)))
    assert traffic == {"all-reduce": Traffic(count=3, bytes=3 * 256 * 4)}


def test_an_all_gather_counts_its_gathered_result():
    def body(v):
        return jax.lax.all_gather(v, "x", tiled=True)[:1] * 2

    traffic = collective_traffic(_compiled_text(body, jnp.ones((2, 1024), jnp.float32)))
    assert traffic == {"all-gather": Traffic(count=1, bytes=2 * 1024 * 4)}
    assert traffic_table(traffic).splitlines()[-1] == "total: 0.01 MiB"


def test_the_costlier_branch_of_a_conditional_counts():
    def body(v):
        return jax.lax.cond(
            v[0, 0] > 0,
            lambda v: jax.lax.psum(v, "x") + v,
            lambda v: jax.lax.psum(v[:, :8], "x").sum() + v,
            v,
        )

    traffic = collective_traffic(_compiled_text(body, jnp.ones((2, 512), jnp.float32)))
    assert traffic == {"all-reduce": Traffic(count=1, bytes=512 * 4)}
