"""`collective_traffic` against programs whose collectives are known: counts and bytes,
loops multiplied by their trip counts, the costlier branch of a conditional; `matmul_flops`
the same way; and `permutes_in_branches`."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from eqxzoo.parallel.collectives import (
    Traffic,
    collective_traffic,
    matmul_flops,
    permutes_in_branches,
    traffic_table,
)


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


def test_matmul_flops_count_each_iteration_and_the_dearer_branch():
    """A loop of 5 (4 x 8) @ (8 x 16) matmuls, then a conditional whose dearer branch runs a
    (4 x 16) @ (16 x 32) one: XLA's cost analysis counts the loop's body once. Given how often
    each branch runs, the branches count so."""

    def program(x, w, v):
        def step(carry, _):
            return jnp.tanh(carry @ w) @ w.T, None

        y = jax.lax.scan(step, x, None, length=5)[0]
        return jax.lax.cond(y[0, 0] > 0, lambda: (y @ w) @ v, lambda: jnp.zeros((4, 32)))

    x, w, v = jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones((16, 32))
    compiled = jax.jit(program).lower(x, w, v).compile()
    pair = 2 * 4 * 8 * 16  # (4 x 8) @ (8 x 16) and (4 x 16) @ (16 x 8)
    assert matmul_flops(compiled.as_text()) == 5 * 2 * pair + pair + 2 * 4 * 16 * 32
    # Told that each branch runs half the visits (the false branch has no matmul):
    halves = matmul_flops(compiled.as_text(), lambda line: [0.5, 0.5])
    assert halves == 5 * 2 * pair + 0.5 * (pair + 2 * 4 * 16 * 32)
    cost = compiled.cost_analysis()
    assert (cost[0] if isinstance(cost, list) else cost)["flops"] < 5 * 2 * pair


def test_permutes_inside_a_branch_are_found_by_their_source():
    """The collective-permutes a device reaches only in one branch of a conditional (XLA:CPU
    cannot run them while another device takes the other branch), not those outside."""

    def shifted(v):
        return jax.lax.ppermute(v, "x", [(0, 1), (1, 0)])

    def body(v):
        v = shifted(v)  # outside any branch
        return jax.lax.cond(v[0, 0] > 0, shifted, lambda v: v * 2, v)

    found = permutes_in_branches(_compiled_text(body, jnp.ones((2, 64), jnp.float32)))
    assert len(found) == 1 and "cond" in found[0] and "ppermute" in found[0], found
    assert permutes_in_branches(_compiled_text(shifted, jnp.ones((2, 64), jnp.float32))) == []
