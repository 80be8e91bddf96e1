"""Logical axis names -> mesh axes: one rules table from which every sharding is derived."""

from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from eqxzoo.nn import Axes

MeshAxes = str | tuple[str, ...] | None

# FSDP over dp on the model dimension, Megatron tensor parallelism over tp, experts over ep,
# the pipeline stage axis over pp. Arrays that no other rule splits over ep or pp would be
# whole on each of those devices: the model dimension also takes ep where the experts have
# not (attention, norms, router, embeddings: FSDP over dp x ep), and the vocabulary takes pp
# (the embeddings live outside the pipeline stages).
DEFAULT_RULES: Mapping[str, MeshAxes] = {
    "stages": "pp",
    "repeats": None,
    "layers": None,
    "embed": ("dp", "ep"),
    "vocab": ("tp", "pp"),
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "experts": "ep",
}


def partition_spec(
    axes: Axes, shape: tuple[int, ...], mesh: Mesh, rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> PartitionSpec:
    """The PartitionSpec of one array with logical ``axes`` and ``shape`` on ``mesh``.

    A dimension stays replicated where its rule names no mesh axis, where the mesh axis is
    already used by an earlier dimension, or where the dimension does not divide evenly (a
    GQA model with fewer kv heads than ``tp`` replicates its kv heads).
    """
    used: set[str] = set()
    spec = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axes = rules.get(name) if name is not None else None
        if isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        chosen = tuple(a for a in (mesh_axes or ()) if a not in used and mesh.shape[a] > 1)
        n_shards = 1
        for axis in chosen:
            n_shards *= mesh.shape[axis]
        if not chosen or size % n_shards != 0:
            spec.append(None)
            continue
        used.update(chosen)
        spec.append(chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*spec)


def tree_shardings(
    shapes: PyTree, axes: PyTree[Axes], mesh: Mesh, rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> PyTree[NamedSharding]:
    """NamedShardings for a pytree of arrays (or shape structs) given its logical axes."""
    return jax.tree.map(
        lambda axes_, leaf: NamedSharding(mesh, partition_spec(axes_, leaf.shape, mesh, rules)),
        axes,
        shapes,
        is_leaf=lambda x: isinstance(x, Axes),
    )
