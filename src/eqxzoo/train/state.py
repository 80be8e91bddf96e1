"""The train state: the model in the pipeline layout, its optimizer state and the step count,
created directly sharded, with every sharding derived from logical axes.

The trainer knows models only through the model contract (`eqxzoo.nn.LanguageModel`): a
``make_model`` factory, called as ``make_model(key=key)``, builds one. A `TrainState` keeps
the stacked blocks viewed as ``[R, P, L / (P R)]`` and sharded over ``pp`` on ``P``
(`eqxzoo.train.layout`). Its logical axes (`train_state_axes`) name every array's axes, the
optimizer state's included (its parameter-shaped parts take the parameters' axes), and the
sharding rules turn them into NamedShardings (`state_shardings`).
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, Sharding
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from eqxzoo.errors import UserError
from eqxzoo.nn import Axes, LanguageModel, logical_axes
from eqxzoo.nn.lora import is_adapter_path
from eqxzoo.optim import OptimizerConfig, build_optimizer, trainable_mask
from eqxzoo.parallel import (
    MeshError,
    Schedule,
    check_layers_fit,
    stage_layers,
    staged_axes,
    tree_shardings,
)
from eqxzoo.runtime import on_every_process
from eqxzoo.train.settings import StepConfig

ModelFactory = Callable[..., LanguageModel]

LAYER_AXES = ("repeats", "stages", "layers")


class TrainState(eqx.Module):
    step: Int[Array, ""]
    model: LanguageModel
    opt_state: PyTree


def split_trainable(model: LanguageModel, config: OptimizerConfig) -> tuple[PyTree, PyTree]:
    """``(trainable, frozen)``: `eqx.partition` by the optimizer's freeze patterns."""
    return eqx.partition(model, trainable_mask(model, config.freeze))


def cast_floats(tree: PyTree, dtype: jnp.dtype | str) -> PyTree:
    """Every floating array of ``tree`` cast to ``dtype``; other leaves unchanged."""
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree)


def cast_params(model: LanguageModel, dtype: jnp.dtype | str) -> LanguageModel:
    """The parameters as a run keeps them: in ``dtype`` (``precision.params``), but LoRA
    adapters (`eqxzoo.nn.lora`) in float32 whatever it is, as their optimizer state."""

    def cast(path, leaf):
        if not eqx.is_inexact_array(leaf):
            return leaf
        adapter = is_adapter_path(jax.tree_util.keystr(path))
        return leaf.astype(jnp.float32 if adapter else dtype)

    return jax.tree_util.tree_map_with_path(cast, model)


def _init_pipeline_model(
    make_model: ModelFactory, schedule: Schedule, key: PRNGKeyArray
) -> LanguageModel:
    """``make_model(key=key)`` with its blocks in the pipeline layout, value for value the
    same, built from the model's own per-layer keys viewed as ``(R, P, k)``.

    Every block array is then created with its stage axis, so XLA splits the random-number
    generation over ``pp`` as the output sharding asks. Reshaping the plain ``(L, ...)``
    stack cannot carry that split back (``P`` is not a block of ``L``): every pp device
    would generate all L layers, twice its share, plus threefry's temporaries.
    """
    model = make_model(key=key)  # its plain blocks' weights are dead code under jit
    layer_keys = stage_layers(model.block_keys(key), schedule)
    weights, _ = eqx.partition(model.make_layers(layer_keys), eqx.is_inexact_array)
    # Per-layer data (integer arrays such as sliding windows) from the plain blocks, placed
    # by the schedule: `make_layers` places it as if its keys were in layer order.
    plain_data, static = eqx.partition(
        eqx.filter(model.blocks.layers, eqx.is_inexact_array, inverse=True), eqx.is_array
    )
    layers = eqx.combine(weights, stage_layers(plain_data, schedule), static)
    return eqx.tree_at(lambda m: m.blocks.layers, model, layers)


def _build_state(make_model: ModelFactory, config: StepConfig, key: PRNGKeyArray) -> TrainState:
    model = _init_pipeline_model(make_model, config.schedule, key)
    model = cast_params(model, config.precision.params)
    trainable, _ = split_trainable(model, config.optimizer)
    opt_state = build_optimizer(config.optimizer).init(trainable)
    return TrainState(step=jnp.zeros((), jnp.int32), model=model, opt_state=opt_state)


def train_state_axes(make_model: ModelFactory, *, config: StepConfig) -> PyTree[Axes]:
    """The logical axes of every array of the `TrainState` (computing nothing).

    The model's come from its modules (`logical_axes` of the plain model, the blocks'
    leading ``layers`` axis restaged as ``repeats, stages, layers``); the optimizer state's
    per-parameter parts (Adam's moments) take the trainable parameters' axes
    (`optax.tree_map_params`), factored ones their leading layer axes; the rest (counts) has
    no name.
    """
    return _state_shape_and_axes(make_model, config)[1]


def pipeline_model_axes(plain_model: LanguageModel) -> PyTree[Axes]:
    """The logical axes of ``plain_model``'s arrays in the pipeline layout (its blocks'
    leading ``layers`` axis restaged as ``repeats, stages, layers``)."""
    model_axes = logical_axes(plain_model)
    return eqx.tree_at(lambda m: m.blocks.layers, model_axes, staged_axes(model_axes.blocks.layers))


def _state_shape_and_axes(
    make_model: ModelFactory, config: StepConfig
) -> tuple[TrainState, PyTree[Axes]]:
    """The `TrainState`'s shapes and its logical axes (see `train_state_axes`), traced once."""
    key = jax.random.key(0)
    plain_model = eqx.filter_eval_shape(make_model, key=key)
    schedule = config.schedule
    check_layers_fit(plain_model.blocks.n_layers, stages=schedule.stages, repeats=schedule.repeats)
    model_axes = pipeline_model_axes(plain_model)
    state_shape = eqx.filter_eval_shape(_build_state, make_model, config, key)
    trainable = trainable_mask(state_shape.model, config.optimizer.freeze)
    trainable_axes, _ = eqx.partition(model_axes, trainable)
    trainable_shape, _ = eqx.partition(state_shape.model, trainable)
    opt_axes = optax.tree_map_params(
        build_optimizer(config.optimizer),
        _statistic_axes,
        state_shape.opt_state,
        trainable_axes,
        trainable_shape,
        transform_non_params=lambda leaf: Axes((None,) * len(leaf.shape)),
        is_leaf=lambda x: isinstance(x, Axes) or x is None,
    )
    axes = eqx.tree_at(
        lambda state: (state.step, state.model, state.opt_state),
        state_shape,
        (Axes(()), model_axes, opt_axes),
    )
    return state_shape, axes


def _statistic_axes(statistic, axes: Axes | None, parameter) -> Axes | None:
    """The axes of an optimizer statistic kept per parameter: the parameter's own, or, for a
    factored statistic (Adafactor's row and column moments), the leading layer axes it keeps.
    Frozen parameters (None) have none."""
    if axes is None or statistic.shape == parameter.shape:
        return axes
    kept = []
    for name, size, parameter_size in zip(axes.names, statistic.shape, parameter.shape):
        if name not in LAYER_AXES or size != parameter_size:
            break
        kept.append(name)
    return Axes((*kept, *(None,) * (len(statistic.shape) - len(kept))))


def state_shardings(
    state_shape: TrainState, axes: PyTree[Axes], *, config: StepConfig, mesh: Mesh
) -> PyTree[NamedSharding]:
    """NamedShardings for every array of a `TrainState` from its logical ``axes`` and
    ``config``'s sharding rules."""
    return tree_shardings(state_shape, axes, mesh, config.rules)


def abstract_state(shapes: PyTree, shardings: PyTree[Sharding]) -> PyTree:
    """``shapes``' arrays (or shape structs) as `jax.ShapeDtypeStruct`s placed on
    ``shardings``: targets for restoring and for ahead-of-time compilation."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        shapes,
        shardings,
    )


def abstract_train_state(make_model: ModelFactory, *, config: StepConfig, mesh: Mesh) -> TrainState:
    """The `TrainState` as `jax.ShapeDtypeStruct`s carrying their shardings, computing nothing:
    the target of a checkpoint restore and of ahead-of-time compilation."""
    if config.schedule.stages != mesh.shape["pp"]:
        raise MeshError(
            f"the schedule has {config.schedule.stages} stages but the mesh has "
            f"pp={mesh.shape['pp']}"
        )
    state_shape, axes = _state_shape_and_axes(make_model, config)
    return abstract_state(state_shape, state_shardings(state_shape, axes, config=config, mesh=mesh))


def init_train_state(
    make_model: ModelFactory, key: PRNGKeyArray, *, config: StepConfig, mesh: Mesh
) -> TrainState:
    """A fresh `TrainState`, every array created directly with its final sharding (one jit
    with ``out_shardings``: no parameter is ever whole on one device)."""
    target = abstract_train_state(make_model, config=config, mesh=mesh)
    shardings = jax.tree.map(lambda leaf: leaf.sharding, target)
    build = functools.partial(_build_state, make_model, config)
    return jax.jit(build, out_shardings=shardings)(key)


def _index_bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` per axis of a shard's index (as ``make_array_from_callback`` gives)."""
    padded = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(part.indices(size)[:2] for part, size in zip(padded, shape, strict=True))


def _read_staged(
    source: Any,
    bounds: tuple[tuple[int, int], ...],
    staged_shape: tuple[int, ...],
    placement: np.ndarray,
) -> np.ndarray:
    """The shard ``bounds`` of the ``(R, P, k, ...)`` view of a stacked ``(L, ...)``
    ``source``: layer ``v k + i`` sits at ``[r, p, i]`` where ``placement[r, p] == v``
    (`stage_layers`), so each ``(r, p)`` of the shard is one run of consecutive layers."""
    (r0, r1), (p0, p1), (i0, i1), *rest = bounds
    per_stage = staged_shape[2]
    inner = tuple(slice(start, stop) for start, stop in rest)
    shape = (r1 - r0, p1 - p0, i1 - i0, *(stop - start for start, stop in rest))
    shard = np.empty(shape, source.dtype)
    for repeat in range(r0, r1):
        for stage in range(p0, p1):
            first = int(placement[repeat, stage]) * per_stage
            layers = source[(slice(first + i0, first + i1), *inner)]
            shard[repeat - r0, stage - p0] = np.asarray(layers)
    return shard


def _load_array(source: Any, goal: jax.ShapeDtypeStruct, placement: np.ndarray | None) -> jax.Array:
    """``source`` (a sliceable array in the plain layout) as ``goal``'s sharded array (staged
    by ``placement``, when given: `_read_staged`): each device's shard read from ``source``
    alone, once per distinct shard on this process."""
    shards: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
        bounds = _index_bounds(index, goal.shape)
        if bounds not in shards:
            if placement is not None:
                shard = _read_staged(source, bounds, goal.shape, placement)
            else:
                shard = np.asarray(source[tuple(slice(a, b) for a, b in bounds)])
            shards[bounds] = shard.astype(goal.dtype)
        return shards[bounds]

    return jax.make_array_from_callback(goal.shape, goal.sharding, read)


def init_train_state_from(
    make_model: ModelFactory, source: LanguageModel, *, config: StepConfig, mesh: Mesh
) -> TrainState:
    """A `TrainState` whose parameters are ``source``'s, with a fresh optimizer state at step 0.

    ``source`` is the model in the plain layout (blocks stacked on one leading layer axis)
    whose arrays are anything read by slices (``source_array[tuple_of_slices]`` gives a numpy
    array): numpy arrays, or lazy readers of a checkpoint such as `models.hf.open_hf`'s. Each
    process reads only the shards its devices hold, straight into the staged, sharded
    layout, cast to ``config.precision.params``: no parameter is ever whole on one device
    or host (unless its sharding replicates it).

    A reader may refuse what it reads with a `UserError` (`models.tensor_files` refuses
    non-finite weights). Each process reads different slices: one that refused stops
    reading, the others read on, and then every process raises if any refused (its own
    error, or one saying another process refused) instead of going on to wait for it.
    """
    target = abstract_train_state(make_model, config=config, mesh=mesh)
    axes = train_state_axes(make_model, config=config)
    # Arrays are matched by where they sit: how the run runs the model (its static options,
    # such as remat or the kernels) may differ from the source's.
    source_paths, source_leaves = zip(*jax.tree_util.tree_leaves_with_path(source), strict=True)
    target_pairs, target_tree = jax.tree_util.tree_flatten_with_path(target.model)
    target_paths, target_leaves = zip(*target_pairs, strict=True)
    if source_paths != target_paths:
        raise ValueError("the source model's arrays differ from those of the model the run builds")
    arrays, refusal = [], None
    for source_leaf, goal, leaf_axes in zip(
        source_leaves, target_leaves, jax.tree.leaves(axes.model), strict=True
    ):
        staged = tuple(leaf_axes.names[: len(LAYER_AXES)]) == LAYER_AXES
        plain_shape = (math.prod(goal.shape[:3]), *goal.shape[3:]) if staged else goal.shape
        if tuple(source_leaf.shape) != tuple(plain_shape):
            raise ValueError(
                f"a source array has shape {tuple(source_leaf.shape)}; the run's model expects "
                f"{tuple(plain_shape)}"
            )
        try:
            placement = config.schedule.virtual_stages if staged else None
            arrays.append(_load_array(source_leaf, goal, placement))
        except UserError as error:
            refusal = error
            break
    if not on_every_process(refusal is None):
        raise refusal or UserError(
            "another process refused the weights it read (its error line says why)"
        )
    model = jax.tree.unflatten(target_tree, arrays)
    shardings = jax.tree.map(lambda leaf: leaf.sharding, target)

    def fresh_state(model: LanguageModel) -> TrainState:
        trainable, _ = split_trainable(model, config.optimizer)
        opt_state = build_optimizer(config.optimizer).init(trainable)
        return TrainState(step=jnp.zeros((), jnp.int32), model=model, opt_state=opt_state)

    return jax.jit(fresh_state, out_shardings=shardings, donate_argnums=0)(model)
