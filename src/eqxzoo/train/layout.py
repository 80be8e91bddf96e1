"""Layouts of the train state: the pipeline's and the checkpoints'.

In the pipeline layout the stacked blocks are viewed as ``(R, P, k, ...)`` (repeats, stages,
layers per stage) and sharded over ``pp`` on ``P``: what the step reads. Checkpoints hold
every staged array as ``(L, ...)`` in layer order, the layer axis sharded over ``pp`` where
``P`` was, so a checkpoint restores onto another ``pp``, ``repeats`` or placement (``zb_v``
places chunks in a V: `eqxzoo.parallel.Schedule.virtual_stages`). A
leaf is staged when its logical axes (`eqxzoo.train.state.train_state_axes`) start with
``repeats, stages, layers``: the model's blocks and the optimizer moments that mirror them.
"""

import functools
from collections.abc import Mapping

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PyTree

from eqxzoo.nn import Axes, LanguageModel
from eqxzoo.parallel import MeshAxes, Schedule, partition_spec, stage_layers, unstage_layers
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import (
    LAYER_AXES,
    ModelFactory,
    TrainState,
    abstract_state,
    abstract_train_state,
    train_state_axes,
)


def to_pipeline_layout(model: LanguageModel, schedule: Schedule) -> LanguageModel:
    """``model`` with its blocks viewed as ``(R, P, k, ...)`` for ``schedule``."""
    return eqx.tree_at(
        lambda m: m.blocks.layers,
        model,
        stage_layers(model.blocks.layers, schedule),
    )


def from_pipeline_layout(model: LanguageModel, schedule: Schedule) -> LanguageModel:
    """The plain model (blocks with one leading layer axis, in layer order) from
    ``schedule``'s pipeline layout."""
    return eqx.tree_at(
        lambda m: m.blocks.layers, model, unstage_layers(model.blocks.layers, schedule)
    )


def _is_staged(axes: Axes) -> bool:
    return tuple(axes.names[: len(LAYER_AXES)]) == LAYER_AXES


@functools.lru_cache(maxsize=64)
def _relayout_to(ndim: int, shape: tuple[int, ...], sharding: NamedSharding, schedule: Schedule):
    """``(R, P, k, ...)`` to ``(L, ...)`` or back (from ``ndim`` to ``shape``'s rank) in
    ``schedule``'s placement, onto ``sharding``."""

    def convert(leaf):
        if len(shape) == ndim - 2:
            return unstage_layers(leaf, schedule)
        if len(shape) == ndim + 2:
            return stage_layers(leaf, schedule)
        return leaf.reshape(shape)

    return jax.jit(convert, out_shardings=sharding)


def _relayout(
    state: TrainState, target: TrainState, schedule: Schedule, *, consume: bool
) -> TrainState:
    """``state``'s arrays in ``target``'s shapes and shardings, one array at a time;
    with ``consume``, each reshaped source array is deleted at once, so the conversion never
    holds more than the state plus its largest array (moe_1b on CPU has no room for two
    states). Arrays already in their target form are passed through."""

    def convert(leaf, goal):
        if leaf.shape == goal.shape and leaf.sharding == goal.sharding:
            return leaf
        # One conversion at a time: XLA:CPU's in-process collectives can starve each other
        # of threads when many small resharding programs run at once.
        convert_to = _relayout_to(leaf.ndim, goal.shape, goal.sharding, schedule)
        converted = jax.block_until_ready(convert_to(leaf))
        if consume:
            leaf.delete()
        return converted

    return jax.tree.map(convert, jax.block_until_ready(state), target)


def abstract_checkpoint_layout(
    target: TrainState, axes: PyTree[Axes], rules: Mapping[str, MeshAxes]
) -> TrainState:
    """`checkpoint_layout` of an abstract state (`abstract_train_state`) whose arrays have
    logical ``axes``: a restore target. The merged layer axis is split as ``stages`` was
    (by ``rules``), the other axes as before."""

    def plain(leaf, leaf_axes: Axes):
        if not _is_staged(leaf_axes):
            return leaf
        repeats, stages, per_stage, *rest = leaf.shape
        shape = (repeats * stages * per_stage, *rest)
        merged_axes = Axes(("stages", *leaf_axes.names[len(LAYER_AXES) :]))
        mesh = leaf.sharding.mesh
        sharding = NamedSharding(mesh, partition_spec(merged_axes, shape, mesh, rules))
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(plain, target, axes)


def checkpoint_layout(
    state: TrainState,
    axes: PyTree[Axes],
    rules: Mapping[str, MeshAxes],
    schedule: Schedule,
    *,
    consume: bool = False,
) -> TrainState:
    """The state with every array staged by ``schedule`` ``(R, P, k, ...)`` as ``(L, ...)``
    in layer order: what checkpoints hold. With ``consume`` the staged arrays of ``state``
    are deleted as they are converted."""
    shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
    target = abstract_checkpoint_layout(abstract_state(state, shardings), axes, rules)
    return _relayout(state, target, schedule, consume=consume)


def from_checkpoint_layout(
    state: TrainState, target: TrainState, schedule: Schedule, *, consume: bool = False
) -> TrainState:
    """Inverse of `checkpoint_layout` onto ``target``'s shapes and shardings, staged by
    ``schedule`` (``consume``: delete each converted array of ``state``)."""
    return _relayout(state, target, schedule, consume=consume)


def abstract_checkpoint_state(
    make_model: ModelFactory, *, config: StepConfig, mesh: Mesh
) -> TrainState:
    """What a checkpoint of a run holds, as sharded shape structs: the restore target."""
    return abstract_checkpoint_layout(
        abstract_train_state(make_model, config=config, mesh=mesh),
        train_state_axes(make_model, config=config),
        config.rules,
    )
