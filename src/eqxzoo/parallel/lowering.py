"""Lowering without the open sharding constraints JAX puts on every value of a partly manual
region.

Inside a `jax.shard_map` manual over some of the mesh's axes only (a pipeline's region is
manual over pp and the batch's axes and leaves tp to the partitioner; the experts' over ep),
every value's type carries a sharding on a mesh of Manual and Auto axes, and JAX 0.10 lowers
each primitive's output wrapped in a sharding constraint of that type
(``jax._src.interpreters.mlir.lower_with_sharding_in_types``, whose own TODO calls it bloat).
On Auto axes such a constraint names no axis and leaves every dimension open: it constrains
nothing, and Shardy propagates through each one. tiny MoE's one-stage train step had 5,319
of them (21 are the code's own), and compiling the tiny and MoE calibration steps took 30%
longer with them (15.2 s against 10.7 s; 17.9 against 12.1), for the same program: the same
collective bytes and FLOPs, memory within 4 KiB.

`drop_open_sharding_constraints` returns such an output unwrapped and leaves every other
constraint as JAX makes it: where the type's spec names an axis (unreduced and reduced ones
too), or any axis of its mesh is Explicit (a sharding that is part of the type).
`eqxzoo.parallel` installs it on import.
"""

from jax.sharding import AxisType

_INSTALLED = "_eqxzoo_drops_open_constraints"


def drop_open_sharding_constraints() -> bool:
    """Wrap JAX's lowering of a value's sharding in its type so that a constraint naming no
    axis on a mesh of no Explicit axis is not emitted. Idempotent; False (and nothing done)
    where this JAX has no such function."""
    try:
        from jax._src.interpreters import mlir
    except ImportError:
        return False
    lower = getattr(mlir, "lower_with_sharding_in_types", None)
    if lower is None:
        return False
    if getattr(lower, _INSTALLED, False):
        return True

    def lower_unless_open(ctx, op, aval):
        spec, mesh = aval.sharding.spec, aval.sharding.mesh
        if (
            all(entry is None for entry in spec)
            and not getattr(spec, "unreduced", None)
            and not getattr(spec, "reduced", None)
            and AxisType.Explicit not in mesh.axis_types
        ):
            return op
        return lower(ctx, op, aval)

    setattr(lower_unless_open, _INSTALLED, True)
    mlir.lower_with_sharding_in_types = lower_unless_open
    return True
