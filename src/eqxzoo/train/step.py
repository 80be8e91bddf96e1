"""The training step: pipelined loss, gradient accumulation, filtered optax update.

A `TrainState` holds the model in the pipeline layout (the stacked blocks viewed as
``[R, P, L / (P R)]`` and sharded over ``pp`` on ``P``), the optimizer state of its
trainable part and the step count. `init_train_state` creates it directly sharded (one jit
with ``out_shardings``: no parameter is ever whole on one device); `make_train_step` returns
the jitted step ``(state, batch) -> (state, metrics)`` with the old state donated.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from eqxzoo.nn import logical_axes
from eqxzoo.optim import (
    OptimizerConfig,
    build_optimizer,
    learning_rate_schedule,
    trainable_mask,
)
from eqxzoo.parallel import (
    DEFAULT_RULES,
    MESH_AXES,
    MeshAxes,
    MeshConfig,
    MeshError,
    Schedule,
    check_model_fits,
    run_pipeline,
    stage_layers,
    staged_axes,
    tree_shardings,
    unstage_layers,
)
from models import DecoderBlock, DecoderLM, summarize_layer_aux

Batch = dict[str, Int[Array, "grad_accum microbatches batch seq"]]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """Parameters are stored in ``params`` (fp32 master weights), cast to ``compute`` for the
    forward and backward pass, and the logits/loss are taken in ``output``."""

    params: str = "float32"
    compute: str = "float32"
    output: str = "float32"

    def __post_init__(self):
        for field in ("params", "compute", "output"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(
                    f"precision.{field} must be one of {sorted(DTYPES)}, got {getattr(self, field)!r}"
                )


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything the step needs besides the model: schedule, optimizer, loss weights."""

    schedule: Schedule
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: Precision = Precision()
    load_balance_weight: float = 0.01
    router_z_weight: float = 0.001
    remat_stages: bool = True
    bubble_fill: float = 0.0


class TrainState(eqx.Module):
    step: Int[Array, ""]
    model: DecoderLM
    opt_state: PyTree


def to_pipeline_layout(model: DecoderLM, schedule: Schedule) -> DecoderLM:
    return eqx.tree_at(
        lambda m: m.blocks.layers,
        model,
        stage_layers(model.blocks.layers, schedule.stages, schedule.repeats),
    )


def from_pipeline_layout(model: DecoderLM) -> DecoderLM:
    """The plain model (blocks with one leading layer axis) from the pipeline layout."""
    return eqx.tree_at(lambda m: m.blocks.layers, model, unstage_layers(model.blocks.layers))


def split_trainable(model: DecoderLM, config: OptimizerConfig) -> tuple[PyTree, PyTree]:
    """``(trainable, frozen)``: `eqx.partition` by the optimizer's freeze patterns."""
    return eqx.partition(model, trainable_mask(model, config.freeze))


def state_shardings(
    state_shape: TrainState,
    model_config,
    *,
    config: StepConfig,
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
) -> PyTree[NamedSharding]:
    """NamedShardings for every array of a `TrainState`, all from the logical-axis rules.

    Optimizer-state subtrees shaped like the trainable parameters (Adam's moments) take the
    parameters' shardings; everything else (step, counts, factored statistics) is replicated.
    """
    plain_shape = eqx.filter_eval_shape(DecoderLM, model_config, key=jax.random.key(0))
    axes = logical_axes(plain_shape)
    axes = eqx.tree_at(lambda m: m.blocks.layers, axes, staged_axes(axes.blocks.layers))
    model_sharding = tree_shardings(state_shape.model, axes, mesh, rules)
    trainable_sharding, _ = eqx.partition(
        model_sharding, trainable_mask(state_shape.model, config.optimizer.freeze)
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    trainable_shape, _ = eqx.partition(
        state_shape.model, trainable_mask(state_shape.model, config.optimizer.freeze)
    )
    params_structure = jax.tree.structure(trainable_shape)
    params_shapes = [leaf.shape for leaf in jax.tree.leaves(trainable_shape)]

    def is_params_like(subtree) -> bool:
        return jax.tree.structure(subtree) == params_structure and params_shapes == [
            leaf.shape for leaf in jax.tree.leaves(subtree)
        ]

    opt_sharding = jax.tree.map(
        lambda x: trainable_sharding if is_params_like(x) else replicated,
        state_shape.opt_state,
        is_leaf=is_params_like,
    )
    return eqx.tree_at(
        lambda state: (state.step, state.model, state.opt_state),
        state_shape,
        (replicated, model_sharding, opt_sharding),
    )


def _check_mesh(model_config, config: StepConfig, mesh: Mesh) -> None:
    mesh_config = MeshConfig(**{axis: mesh.shape[axis] for axis in MESH_AXES})
    check_model_fits(
        mesh_config,
        n_layers=model_config.n_layers,
        n_heads=model_config.n_heads,
        n_experts=None if model_config.moe is None else model_config.moe.n_experts,
        repeats=config.schedule.repeats,
    )
    if config.schedule.stages != mesh_config.pp:
        raise MeshError(
            f"the schedule has {config.schedule.stages} stages but the mesh has pp={mesh_config.pp}"
        )


def _init_pipeline_model(model_config, schedule: Schedule, key: PRNGKeyArray) -> DecoderLM:
    """``to_pipeline_layout(DecoderLM(model_config, key=key), schedule)``, value for value, with
    the blocks built from the per-layer keys viewed as ``(R, P, k)``.

    Every block array is then created with its stage axis, so XLA splits the random-number
    generation over ``pp`` as the output sharding asks. Reshaping the plain ``(L, ...)``
    stack cannot carry that split back (``P`` is not a block of ``L``): every pp device
    would generate all L layers, twice its share, plus threefry's temporaries.
    """
    model = DecoderLM(model_config, key=key)  # its plain blocks are dead code under jit
    _, blocks_key, _ = jax.random.split(key, 3)  # as DecoderLM.__init__ splits its key
    layer_keys = stage_layers(
        jax.random.split(blocks_key, model_config.n_layers), schedule.stages, schedule.repeats
    )

    def make_block(layer_key):
        return DecoderBlock(model_config, key=layer_key)

    layers = eqx.filter_vmap(eqx.filter_vmap(eqx.filter_vmap(make_block)))(layer_keys)
    return eqx.tree_at(lambda m: m.blocks.layers, model, layers)


def _build_state(model_config, config: StepConfig, key: PRNGKeyArray) -> TrainState:
    model = _init_pipeline_model(model_config, config.schedule, key)
    model = _cast(model, DTYPES[config.precision.params])
    trainable, _ = split_trainable(model, config.optimizer)
    opt_state = build_optimizer(config.optimizer).init(trainable)
    return TrainState(step=jnp.zeros((), jnp.int32), model=model, opt_state=opt_state)


def abstract_state(shapes: PyTree, shardings: PyTree[Sharding]) -> PyTree:
    """``shapes``' arrays (or shape structs) as `jax.ShapeDtypeStruct`s placed on
    ``shardings``: targets for restoring and for ahead-of-time compilation."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        shapes,
        shardings,
    )


def abstract_train_state(
    model_config,
    *,
    config: StepConfig,
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
) -> TrainState:
    """The `TrainState` as `jax.ShapeDtypeStruct`s carrying their shardings, computing nothing:
    the target of a checkpoint restore and of ahead-of-time compilation."""
    _check_mesh(model_config, config, mesh)
    state_shape = eqx.filter_eval_shape(_build_state, model_config, config, jax.random.key(0))
    shardings = state_shardings(state_shape, model_config, config=config, mesh=mesh, rules=rules)
    return abstract_state(state_shape, shardings)


def init_train_state(
    model_config,
    key: PRNGKeyArray,
    *,
    config: StepConfig,
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
) -> TrainState:
    """A fresh `TrainState`, every array created directly with its final sharding.

    Raises `MeshError` (naming the numbers) if the model cannot be split over ``mesh``.
    """
    target = abstract_train_state(model_config, config=config, mesh=mesh, rules=rules)
    shardings = jax.tree.map(lambda leaf: leaf.sharding, target)
    build = functools.partial(_build_state, model_config, config)
    return jax.jit(build, out_shardings=shardings)(key)


def _cast(tree: PyTree, dtype) -> PyTree:
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree)


def pipelined_loss(
    model: DecoderLM,
    tokens: Int[Array, "microbatches batch seq"],
    targets: Int[Array, "microbatches batch seq"],
    *,
    config: StepConfig,
    mesh: Mesh,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Token-mean cross-entropy plus weighted aux losses, with the blocks pipelined over ``pp``.

    ``model`` is in the pipeline layout. Embedding and head run outside the pipeline.
    """
    model = _cast(model, DTYPES[config.precision.compute])
    n_micro = tokens.shape[0]
    split = NamedSharding(mesh, PartitionSpec(None, "dp"))
    h = model.embed(tokens)
    h, layer_aux_sums = run_pipeline(
        model.blocks.layers,
        h,
        schedule=config.schedule,
        mesh=mesh,
        remat_policy=model.config.remat,
        remat_stages=config.remat_stages,
        bubble_fill=config.bubble_fill,
    )
    logits = jax.lax.with_sharding_constraint(model.head(h), split)
    logits = logits.astype(DTYPES[config.precision.output])
    aux = summarize_layer_aux(jax.tree.map(lambda v: v / n_micro, layer_aux_sums))
    return _total_loss(logits, targets, aux, config)


def sequential_loss(
    model: DecoderLM,
    tokens: Int[Array, "microbatches batch seq"],
    targets: Int[Array, "microbatches batch seq"],
    *,
    config: StepConfig,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The same loss computed the plain way: the (unstaged) model vmapped over every sequence."""
    model = _cast(model, DTYPES[config.precision.compute])
    logits, aux = jax.vmap(jax.vmap(model))(tokens)
    aux = jax.tree.map(lambda v: jnp.mean(v, axis=(0, 1)), aux)
    return _total_loss(logits.astype(DTYPES[config.precision.output]), targets, aux, config)


def _total_loss(logits, targets, aux, config: StepConfig):
    cross_entropy = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
    loss = cross_entropy
    if "load_balance_loss" in aux:
        loss = loss + config.load_balance_weight * aux["load_balance_loss"]
        loss = loss + config.router_z_weight * aux["router_z_loss"]
    return loss.astype(jnp.float32), {"cross_entropy": cross_entropy, **aux}


LossFn = Callable[[DecoderLM, Array, Array], tuple[Array, dict[str, Array]]]


def train_step(
    state: TrainState, batch: Batch, *, config: StepConfig, loss_fn: LossFn
) -> tuple[TrainState, dict[str, Array]]:
    """One optimizer step over ``G`` accumulated gradients of ``loss_fn`` (not jitted).

    A step whose loss or gradient norm is not finite leaves the whole state as it was
    (``metrics["skipped"] == 1``): ``state.step`` counts applied updates, like the optimizer's
    own schedule counter, so the reported learning rate is the one the next update uses.
    """
    optimizer = build_optimizer(config.optimizer)
    trainable, frozen = split_trainable(state.model, config.optimizer)

    def microbatch_grads(carry, micro):
        grad_sum, metric_sum = carry

        def loss_of(trainable):
            return loss_fn(eqx.combine(trainable, frozen), micro["tokens"], micro["targets"])

        (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        metrics = {"loss": loss, **metrics}
        return (
            jax.tree.map(jnp.add, grad_sum, grads),
            jax.tree.map(jnp.add, metric_sum, metrics),
        ), None

    grad_zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), trainable)

    def first_metrics():
        loss, metrics = loss_fn(state.model, batch["tokens"][0], batch["targets"][0])
        return {"loss": loss, **metrics}

    metric_shapes = jax.eval_shape(first_metrics)
    zeros = (
        grad_zeros,
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes),
    )
    if batch["tokens"].shape[0] == 1:
        (grad_sum, metric_sum), _ = microbatch_grads(zeros, jax.tree.map(lambda x: x[0], batch))
    else:
        (grad_sum, metric_sum), _ = jax.lax.scan(microbatch_grads, zeros, batch)
    n_accum = batch["tokens"].shape[0]
    grads = jax.tree.map(lambda g, p: (g / n_accum).astype(p.dtype), grad_sum, trainable)
    metrics = jax.tree.map(lambda m: m / n_accum, metric_sum)
    updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
    updated = optax.apply_updates(trainable, updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    keep_finite = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    metrics.update(
        grad_norm=grad_norm,
        learning_rate=learning_rate_schedule(config.optimizer)(state.step),
        tokens=jnp.asarray(batch["tokens"].size, jnp.int32),
        skipped=jnp.logical_not(finite).astype(jnp.int32),
    )
    new_state = TrainState(
        step=state.step + finite.astype(state.step.dtype),
        model=eqx.combine(keep_finite(updated, trainable), frozen),
        opt_state=keep_finite(opt_state, state.opt_state),
    )
    return new_state, metrics


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``(G, M, B, T)`` batches are split over ``dp`` on ``B``."""
    return NamedSharding(mesh, PartitionSpec(None, None, "dp", None))


def make_train_step(
    config: StepConfig, mesh: Mesh
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Array]]]:
    """The jitted pipelined train step; the incoming state is donated.

    The batch is constrained to `batch_sharding` inside the step, so a batch that arrives
    unsharded is still split over ``dp`` rather than computed in full on every replica.
    """

    def loss_fn(model, tokens, targets):
        return pipelined_loss(model, tokens, targets, config=config, mesh=mesh)

    def step(state, batch):
        batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh))
        state, metrics = train_step(state, batch, config=config, loss_fn=loss_fn)
        # Replicated, so that every process can read them (multi-process runs).
        replicated = NamedSharding(mesh, PartitionSpec())
        return state, jax.lax.with_sharding_constraint(metrics, replicated)

    return jax.jit(step, donate_argnums=0)


def make_eval_step(
    config: StepConfig, mesh: Mesh
) -> Callable[[DecoderLM, Batch], Float[Array, ""]]:
    """The jitted evaluation: token-mean cross-entropy of a ``(1, M, B, T)`` batch through the
    same pipeline as training (``model`` in the pipeline layout)."""

    def evaluate(model, batch):
        batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh))
        _, metrics = pipelined_loss(
            model, batch["tokens"][0], batch["targets"][0], config=config, mesh=mesh
        )
        return metrics["cross_entropy"]

    return jax.jit(evaluate, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _is_staged_leaf(path, leaf) -> bool:
    """A leaf under ``blocks.layers`` (of the model or of an optimizer moment) that carries
    the staged ``(R, P, k)`` leading axes."""
    return ".blocks.layers." in jax.tree_util.keystr(path) and len(leaf.shape) >= 3


def _plain_spec(sharding: NamedSharding, rank: int) -> NamedSharding:
    """The staged ``(R, P, k, ...)`` sharding's ``P`` entry moved to the merged layer axis."""
    spec = tuple(sharding.spec) + (None,) * (rank - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(spec[1], *spec[3:]))


@functools.lru_cache(maxsize=64)
def _reshape_to(shape: tuple[int, ...], sharding: NamedSharding):
    return jax.jit(lambda leaf: leaf.reshape(shape), out_shardings=sharding)


def _relayout(state: TrainState, target: TrainState, *, consume: bool) -> TrainState:
    """``state``'s arrays reshaped to ``target``'s shapes and shardings, one array at a time;
    with ``consume``, each reshaped source array is deleted at once, so the conversion never
    holds more than the state plus its largest array (moe_1b on CPU has no room for two
    states). Arrays already in their target form are passed through."""

    def convert(leaf, goal):
        if leaf.shape == goal.shape and leaf.sharding == goal.sharding:
            return leaf
        # One conversion at a time: XLA:CPU's in-process collectives can starve each other
        # of threads when many small resharding programs run at once.
        converted = jax.block_until_ready(_reshape_to(goal.shape, goal.sharding)(leaf))
        if consume:
            leaf.delete()
        return converted

    return jax.tree.map(convert, jax.block_until_ready(state), target)


def checkpoint_layout(state: TrainState, *, consume: bool = False) -> TrainState:
    """The state with every staged ``(R, P, k, ...)`` array viewed as ``(L, ...)``, the layer
    axis sharded over ``pp`` where ``P`` was: what checkpoints hold, so a checkpoint can be
    restored with other ``pp`` or ``repeats`` (the layer order never changes). With
    ``consume`` the staged arrays of ``state`` are deleted as they are converted."""
    shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
    target = abstract_checkpoint_layout(abstract_state(state, shardings))
    return _relayout(state, target, consume=consume)


def abstract_checkpoint_layout(target: TrainState) -> TrainState:
    """`checkpoint_layout` of an abstract state (`abstract_train_state`): a restore target."""

    def plain(path, leaf):
        if not _is_staged_leaf(path, leaf):
            return leaf
        layers = leaf.shape[0] * leaf.shape[1] * leaf.shape[2]
        return jax.ShapeDtypeStruct(
            (layers, *leaf.shape[3:]),
            leaf.dtype,
            sharding=_plain_spec(leaf.sharding, len(leaf.shape)),
        )

    return jax.tree_util.tree_map_with_path(plain, target)


def from_checkpoint_layout(
    state: TrainState, target: TrainState, *, consume: bool = False
) -> TrainState:
    """Inverse of `checkpoint_layout` onto ``target``'s shapes and shardings (``consume``:
    delete each converted array of ``state``)."""
    return _relayout(state, target, consume=consume)
