"""What a model's parameters are: its floating arrays, less its buffers.

A buffer is a floating array a rule moves after each step instead of a gradient
(`BUFFER_FIELDS`: DeepSeek-V3's balancing bias); integer arrays (per-layer data such as
sliding windows) are never parameters. The optimizer trains exactly these (less what a run
freezes), and a model's parameter count counts exactly these.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from eqxzoo.nn.router import BUFFER_FIELDS


def is_buffer(path: tuple) -> bool:
    """Whether the array at ``path`` is a buffer (`BUFFER_FIELDS`), which no gradient or
    optimizer touches."""
    return bool(path) and getattr(path[-1], "name", None) in BUFFER_FIELDS


def is_parameter(path: tuple, leaf) -> bool:
    """Whether ``leaf`` at ``path`` is a parameter: a floating array (or the shape of one, so
    that this works on `jax.eval_shape` output too) that is not a buffer."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        floating = jnp.issubdtype(leaf.dtype, jnp.inexact)
    else:
        floating = eqx.is_inexact_array(leaf)
    return floating and not is_buffer(path)


def parameter_mask(model: PyTree) -> PyTree[bool]:
    """`is_parameter` of every leaf of ``model``."""
    return jax.tree_util.tree_map_with_path(is_parameter, model)
