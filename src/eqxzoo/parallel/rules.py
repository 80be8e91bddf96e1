"""Logical axis names -> mesh axes: one rules table from which every sharding is derived.

Parameters name their axes where they are created (``("embed", "mlp")``); activations and
batches name theirs where they are constrained (``("microbatches", "batch", "seq")``). The
table (`ShardingConfig`, the run config's ``[sharding]`` section) says which mesh axes each
name is split over; `partition_spec` turns a parameter's names into a PartitionSpec and
`activation_spec` an activation's. No other module writes a PartitionSpec by hand.
"""

import dataclasses
from collections.abc import Mapping
from functools import cached_property
from types import MappingProxyType

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from eqxzoo.nn import Axes
from eqxzoo.parallel.mesh import MESH_AXES
from eqxzoo.typed_config import check_fields, refuse, runtime_field

MeshAxes = str | tuple[str, ...] | None

FIXED_RULES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "stages": ("pp",),
        "repeats": (),
        "layers": (),
        "grad_accum": (),
        "microbatches": (),
        "prefix_microbatches": ("pp",),
        "batch": ("dp",),
        "seq": (),
    }
)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """``[sharding]``: the mesh axes each logical axis is split over (``[]``: replicated).

    The defaults: FSDP over dp on the model dimension, Megatron tensor parallelism over tp,
    experts over ep, the pipeline stage axis over pp. Arrays that no other rule splits over
    ep or pp would be whole on each of those devices: the model dimension also takes ep
    where the experts have not (attention, norms, router, embeddings: FSDP over dp x ep),
    and the vocabulary takes pp (the embeddings live outside the pipeline stages).
    The parameter axes (``embed`` to ``experts``) are a user's to change; the pipeline and
    batch axes are fixed by how the trainer works (`FIXED_RULES`: the pipeline runs manual
    over pp, the loader splits each microbatch's sequences over dp, and a model's prefix
    layers, run before the pipeline, split the microbatches over pp, which has no stages
    there) and named here so that every sharding comes from this one table.
    """

    stages: tuple[str, ...] = runtime_field(FIXED_RULES["stages"])
    repeats: tuple[str, ...] = runtime_field(FIXED_RULES["repeats"])
    layers: tuple[str, ...] = runtime_field(FIXED_RULES["layers"])
    embed: tuple[str, ...] = runtime_field(("dp", "ep"))
    vocab: tuple[str, ...] = runtime_field(("tp", "pp"))
    heads: tuple[str, ...] = runtime_field(("tp",))
    kv_heads: tuple[str, ...] = runtime_field(("tp",))
    head_dim: tuple[str, ...] = runtime_field(())
    mlp: tuple[str, ...] = runtime_field(("tp",))
    experts: tuple[str, ...] = runtime_field(("ep",))
    grad_accum: tuple[str, ...] = runtime_field(FIXED_RULES["grad_accum"])
    microbatches: tuple[str, ...] = runtime_field(FIXED_RULES["microbatches"])
    prefix_microbatches: tuple[str, ...] = runtime_field(FIXED_RULES["prefix_microbatches"])
    batch: tuple[str, ...] = runtime_field(FIXED_RULES["batch"])
    seq: tuple[str, ...] = runtime_field(FIXED_RULES["seq"])

    def __post_init__(self):
        check_fields(self)
        for field in dataclasses.fields(self):
            axes = getattr(self, field.name)
            unknown = [axis for axis in axes if axis not in MESH_AXES]
            if unknown:
                refuse(field.name, f"{unknown} are not mesh axes; choose from {list(MESH_AXES)}")
            if len(set(axes)) != len(axes):
                refuse(field.name, f"{list(axes)} names a mesh axis twice")
        for name, fixed in FIXED_RULES.items():
            if getattr(self, name) != fixed:
                refuse(
                    name,
                    f"must be {list(fixed)} (fixed by the trainer), got {list(getattr(self, name))}",
                )

    @cached_property
    def rules(self) -> Mapping[str, MeshAxes]:
        """``{logical name: mesh axes or None}`` (read-only)."""
        names = (field.name for field in dataclasses.fields(self))
        return MappingProxyType({name: getattr(self, name) or None for name in names})


DEFAULT_RULES: Mapping[str, MeshAxes] = ShardingConfig().rules


def rule_axes(name: str | None, rules: Mapping[str, MeshAxes]) -> tuple[str, ...]:
    """The mesh axes ``rules`` split logical axis ``name`` over (``()``: replicated)."""
    mesh_axes = rules.get(name) if name is not None else None
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return mesh_axes or ()


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
        chosen = tuple(a for a in rule_axes(name, rules) if a not in used and mesh.shape[a] > 1)
        n_shards = 1
        for axis in chosen:
            n_shards *= mesh.shape[axis]
        if not chosen or size % n_shards != 0:
            spec.append(None)
            continue
        used.update(chosen)
        spec.append(chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*spec)


def activation_spec(
    *names: str | None, rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> PartitionSpec:
    """The PartitionSpec of an activation or batch whose leading axes are ``names`` (trailing
    axes replicated). The config guarantees the split sizes divide (``data.batch_size`` over
    dp), so no shape is needed; usable where only a spec is wanted (shard_map, hints inside it).
    """
    spec = []
    for name in names:
        mesh_axes = rule_axes(name, rules)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes or None)
    return PartitionSpec(*spec)


def activation_sharding(
    mesh: Mesh, *names: str | None, rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> NamedSharding:
    """`activation_spec` on ``mesh``."""
    return NamedSharding(mesh, activation_spec(*names, rules=rules))


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
