"""Logical axis names attached to parameters.

Every module that owns arrays says, next to where it creates them, which *logical* axes each
array has (``("embed", "mlp")``, ``("experts", "embed", "mlp")``); containers that stack
their children along a new leading axis (``Stack``) name that axis too (``"layers"``). The
names are the only sharding knowledge a model has: `eqxzoo.parallel` maps them to mesh axes
with one rules table.
"""

import abc
import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
from jaxtyping import PyTree

from eqxzoo.errors import ConfigError

LogicalName = str | None


@dataclasses.dataclass(frozen=True)
class Axes:
    """The logical axis names of one array, one entry per dimension (``None``: never sharded)."""

    names: tuple[LogicalName, ...]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class AbstractAxesOwner(eqx.Module):
    """A module whose own array fields carry logical axes.

    `param_axes` maps each of its array fields to that array's axis names; `stacked_axis`,
    when set, names a leading axis that this module adds to *every* array below it (as `Stack`
    does). Submodules are visited on their own.
    """

    stacked_axis: ClassVar[str | None] = None

    @abc.abstractmethod
    def param_axes(self) -> Mapping[str, tuple[LogicalName, ...]]:
        raise NotImplementedError


def logical_axes(tree: PyTree) -> PyTree[Axes]:
    """A pytree shaped like ``tree`` whose array leaves are replaced by their `Axes`.

    Raises if an array is found that no enclosing module annotates, or whose rank does not
    match its names: a parameter without logical axes could not be sharded.
    """
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [_axes_at(tree, path, leaf) for path, leaf in leaves_with_paths]
    )


def _axes_at(root, path, leaf) -> Axes:
    prefix: tuple[LogicalName, ...] = ()
    node = root
    own: tuple[LogicalName, ...] | None = None
    for entry in path:
        if isinstance(node, AbstractAxesOwner):
            if node.stacked_axis is not None:
                prefix = prefix + (node.stacked_axis,)
            declared = node.param_axes()
            name = getattr(entry, "name", None)
            own = declared.get(name) if name is not None else None
        else:
            own = None
        node = _child(node, entry)
    if own is None:
        raise ConfigError(f"array at {jax.tree_util.keystr(path)} has no logical axes")
    names = prefix + tuple(own)
    if hasattr(leaf, "ndim") and leaf.ndim != len(names):
        raise ConfigError(
            f"array at {jax.tree_util.keystr(path)} has rank {leaf.ndim} but logical axes {names}"
        )
    return Axes(names)


def _child(node, entry):
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return getattr(node, entry.name)
    if isinstance(entry, jax.tree_util.SequenceKey):
        return node[entry.idx]
    if isinstance(entry, jax.tree_util.DictKey):
        return node[entry.key]
    raise TypeError(f"unsupported pytree path entry {entry!r}")
