"""`eqxzoo.parallel.lowering`: a partly manual region lowers without JAX's open constraints,
and keeps the ones that say something."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqxzoo.parallel import MeshConfig, make_mesh
from eqxzoo.parallel.lowering import drop_open_sharding_constraints


def region(mesh, constrain: bool):
    """``x -> sin(x) * 2 + 1`` in a region manual over dp only (tp left to the partitioner),
    its result constrained over tp if ``constrain``."""

    def body(x):
        y = jnp.sin(x) * 2.0 + 1.0
        if constrain:
            y = jax.lax.with_sharding_constraint(y, P(None, "tp"))
        return y

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"})
    )


def test_a_partly_manual_region_lowers_without_open_constraints_and_keeps_its_own():
    """JAX wraps the body's values in constraints naming no axis (5 of them here where
    `drop_open_sharding_constraints` is not installed): none is left, the one the code asks
    for stays, and the values are the same."""
    assert drop_open_sharding_constraints()  # installed by eqxzoo.parallel: idempotent
    mesh = make_mesh(MeshConfig(dp=2, tp=4), jax.devices()[:8])
    values = jnp.arange(64.0).reshape(8, 8)
    expected = np.asarray(jnp.sin(values) * 2.0 + 1.0)
    x = jax.device_put(values, NamedSharding(mesh, P("dp")))
    for constrain in (False, True):
        step = region(mesh, constrain)
        text = step.lower(x).as_text()
        assert text.count("sdy.sharding_constraint") == int(constrain), text
        np.testing.assert_allclose(step(x), expected, rtol=1e-6)
