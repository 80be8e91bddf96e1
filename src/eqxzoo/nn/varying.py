"""Manual-axis bookkeeping for code that may run inside `jax.shard_map` with ``check_vma``.

Inside a manual region every value carries the mesh axes it varies over. A loop carry must
vary over whatever its body mixes in, and a custom VJP must return each cotangent varying
over exactly the axes its primal did: a primal the same on every device of an axis (used by
each of them) gets the sum of their cotangents. Outside a manual region both are no-ops.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


def varying_axes(value: Array | jax.ShapeDtypeStruct) -> frozenset[str]:
    """The manual mesh axes ``value`` (an array, or the shape of one) varies over (empty
    outside `jax.shard_map`): the one answer every manual region here asks for."""
    aval = value if isinstance(value, jax.ShapeDtypeStruct) else jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    varying = manual.varying if manual is not None else getattr(aval, "vma", None)
    return frozenset(varying or ())


def typed_shape(value: Array | np.ndarray | jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """``value``'s shape and dtype, and the manual axes it varies over (none for a NumPy
    array: a constant a traced function closes over, such as a pullback's folded positions)."""
    aval = value if isinstance(value, jax.ShapeDtypeStruct) else jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, manual_axis_type=manual)


def zeros_of(
    shape: jax.ShapeDtypeStruct, leading: tuple[int, ...] = (), also: tuple[str, ...] = ()
) -> Array:
    """Zeros of ``leading + shape.shape`` varying over the axes ``shape`` (a `typed_shape`)
    does and ``also``: a buffer that holds such values, written at indices varying over
    ``also``, and no more varying than that."""
    zeros = jnp.zeros((*leading, *shape.shape), shape.dtype)
    axes = tuple(sorted(varying_axes(shape) | set(also)))
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def varying_like(initial: Array, *inputs: Array) -> Array:
    """``initial`` made to vary over every axis that ``inputs`` vary over, as a loop carry
    computed from them must."""
    missing = frozenset().union(*map(varying_axes, inputs)) - varying_axes(initial)
    return jax.lax.pcast(initial, tuple(sorted(missing)), to="varying") if missing else initial


def cotangent_for(cotangent: Array, primal: Array) -> Array:
    """``cotangent`` summed over the axes it varies over and ``primal`` does not."""
    extra = varying_axes(cotangent) - varying_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def varying_as(value: Array, primal: Array | jax.ShapeDtypeStruct) -> Array:
    """``value`` varying over exactly the axes ``primal`` does: cast over those it does not
    yet, averaged over those it does and ``primal`` does not, where it must be the same on
    every device of them (the cotangent of a value each device computes alike)."""
    target, have = varying_axes(primal), varying_axes(value)
    extra, missing = tuple(sorted(have - target)), tuple(sorted(target - have))
    if extra:
        value = jax.lax.pmean(value, extra)
    return jax.lax.pcast(value, missing, to="varying") if missing else value
