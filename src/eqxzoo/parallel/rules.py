"""Logical axis names -> mesh axes: one rules table from which every sharding is derived.

Parameters name their axes where they are created (``("embed", "mlp")``); activations and
batches name theirs where they are constrained (``("microbatches", "batch", "seq")``). The
table (`ShardingConfig`, the run config's ``[sharding]`` section) says which mesh axes each
name is split over; `partition_spec` turns a parameter's names into a PartitionSpec and
`activation_spec` an activation's. No other module writes a PartitionSpec by hand.

The table names the axes of `eqxzoo.parallel.MeshConfig` (``dp``, ``pp``, ``tp``, ``ep``) and
``dp_ici``, the part of ``dp`` within one slice: where ``dp`` spans slices its mesh has two
axes, ``dp_dcn x dp_ici``, and `ShardingConfig.rules_on` maps the table's names to them
(``dp``: both; ``dp_ici``: the second). FSDP inside a slice is ``embed = ["dp_ici", "ep"]``:
the weights are then whole in each slice and only the gradient reduction crosses slices.
"""

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from eqxzoo.nn import Axes
from eqxzoo.parallel.mesh import DP_ACROSS_SLICES, DP_WITHIN_SLICE, MESH_AXES, MeshError
from eqxzoo.typed_config import check_fields, refuse, runtime_field

MeshAxes = str | tuple[str, ...] | None
RULE_AXES = (*MESH_AXES, DP_WITHIN_SLICE)

FIXED_RULES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "stages": ("pp",),
        "repeats": (),
        "layers": (),
        "grad_accum": (),
        "microbatches": (),
        "prefix_microbatches": ("pp",),
        "batch": ("dp", "ep"),
        "seq": ("cp",),
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
    over pp, the loader splits each microbatch's sequences over dp and ep (expert parallelism
    borrows data parallelism's devices: outside the experts each ep device holds its own
    sequences) and their tokens over cp (context parallelism), and a model's prefix
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
            unknown = [axis for axis in axes if axis not in RULE_AXES]
            if unknown:
                refuse(field.name, f"{unknown} are not mesh axes; choose from {list(RULE_AXES)}")
            if len(set(axes)) != len(axes) or {"dp", DP_WITHIN_SLICE} <= set(axes):
                refuse(field.name, f"{list(axes)} names a mesh axis twice")
        for name, fixed in FIXED_RULES.items():
            if getattr(self, name) != fixed:
                refuse(
                    name,
                    f"must be {list(fixed)} (fixed by the trainer), got {list(getattr(self, name))}",
                )

    @property
    def rules(self) -> Mapping[str, MeshAxes]:
        """``{logical name: mesh axes or None}`` (read-only) on a mesh whose ``dp`` is one
        axis."""
        return self.rules_on(MESH_AXES)

    def rules_on(self, mesh_axes: tuple[str, ...]) -> Mapping[str, MeshAxes]:
        """`rules` on a mesh with axes ``mesh_axes`` (`MeshConfig.axis_names`): ``dp`` and
        ``dp_ici`` as that mesh has them (one mapping per mesh, the same object each time)."""
        return _rules_on(self, tuple(mesh_axes))


@functools.cache
def _rules_on(config: ShardingConfig, mesh_axes: tuple[str, ...]) -> Mapping[str, MeshAxes]:
    # dp as the mesh has it: whole, split into its parts across and within slices, or (inside
    # a region manual over the slices, which the mesh axes then leave out) its part within.
    dp_parts = tuple(a for a in (DP_ACROSS_SLICES, DP_WITHIN_SLICE) if a in mesh_axes) or ("dp",)
    names = {"dp": dp_parts, DP_WITHIN_SLICE: dp_parts[-1:]}
    rules = {}
    for field in dataclasses.fields(config):
        axes = getattr(config, field.name)
        rules[field.name] = tuple(a for axis in axes for a in names.get(axis, (axis,))) or None
    return MappingProxyType(rules)


DEFAULT_RULES: Mapping[str, MeshAxes] = ShardingConfig().rules


def rule_axes(name: str | None, rules: Mapping[str, MeshAxes]) -> tuple[str, ...]:
    """The mesh axes ``rules`` split logical axis ``name`` over (``()``: replicated)."""
    mesh_axes = rules.get(name) if name is not None else None
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return mesh_axes or ()


def partition_spec(
    axes: Axes,
    shape: tuple[int, ...],
    mesh: Mesh | AbstractMesh,
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
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


def manual_spec(
    *names: str | None, manual_axes: tuple[str, ...], rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> PartitionSpec:
    """`activation_spec` of the part of the rules a `jax.shard_map` manual over
    ``manual_axes`` takes in its specs (the other axes stay with the compiler)."""
    manual = {name: tuple(a for a in rule_axes(name, rules) if a in manual_axes) for name in rules}
    return activation_spec(*names, rules=manual)


def activation_sharding(
    mesh: Mesh | AbstractMesh, *names: str | None, rules: Mapping[str, MeshAxes] = DEFAULT_RULES
) -> NamedSharding:
    """`activation_spec` on ``mesh``."""
    return NamedSharding(mesh, activation_spec(*names, rules=rules))


def tree_shardings(
    shapes: PyTree,
    axes: PyTree[Axes],
    mesh: Mesh | AbstractMesh,
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
) -> PyTree[NamedSharding]:
    """NamedShardings for a pytree of arrays (or shape structs) given its logical axes."""
    check_rules_fit(mesh, rules)
    return jax.tree.map(
        lambda axes_, leaf: NamedSharding(mesh, partition_spec(axes_, leaf.shape, mesh, rules)),
        axes,
        shapes,
        is_leaf=lambda x: isinstance(x, Axes),
    )


def check_rules_fit(mesh: Mesh | AbstractMesh, rules: Mapping[str, MeshAxes]) -> None:
    """Refuse ``rules`` that name mesh axes ``mesh`` lacks: rules made for a mesh whose ``dp``
    is one axis on a mesh where it spans slices, or the other way round."""
    named = {axis for name in rules for axis in rule_axes(name, rules)}
    missing = sorted(named - set(mesh.axis_names))
    if missing:
        raise MeshError(
            f"the sharding rules name mesh axes {missing} that the mesh {dict(mesh.shape)} does "
            "not have: take the rules of ShardingConfig.rules_on(MeshConfig.axis_names) "
            "(StepConfig(mesh_axes=...))"
        )
