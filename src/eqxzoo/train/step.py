"""The training step: gradient accumulation over ``G`` pipelined losses, then a filtered
optax update with a global-norm clip; the evaluation step.

`make_train_step` returns the jitted step ``(state, batch) -> (state, metrics)`` with the old
state donated. The state (`eqxzoo.train.state`), its layouts (`eqxzoo.train.layout`) and the
loss (`eqxzoo.train.loss`) live in their own modules; this one depends on the model only
through the model contract.
"""

import dataclasses
import functools
import hashlib
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PyTree

from eqxzoo.errors import UserError
from eqxzoo.nn import Axes, Documents, LanguageModel, balance_selection_bias
from eqxzoo.nn.parameters import is_buffer
from eqxzoo.optim import build_optimizer, learning_rate_schedule, trainable_mask
from eqxzoo.parallel import DEFAULT_RULES, MeshAxes, Schedule, activation_sharding, stage_layers
from eqxzoo.parallel.collectives import permutes_in_branches
from eqxzoo.parallel.mesh import DP_WITHIN_SLICE
from eqxzoo.parallel.rules import partition_spec, rule_axes
from eqxzoo.train.layout import from_pipeline_layout
from eqxzoo.train.loss import (
    DOCUMENT_FIELDS,
    batch_documents,
    pipelined_loss,
    pipelined_loss_and_grad,
    target_count,
)
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import TrainState, pipeline_model_axes, split_trainable

Batch = dict[str, Int[Array, "grad_accum microbatches batch seq"]]

# ``(model, tokens, targets, normalizer, documents) -> (loss, metrics)``.
LossFn = Callable[
    [LanguageModel, Array, Array, Array, Documents | None], tuple[Array, dict[str, Array]]
]
# ``(model, tokens, targets, normalizer, documents) -> ((loss, metrics), grads)``, grads
# shaped like the model.
LossAndGradFn = Callable[
    [LanguageModel, Array, Array, Array, Documents | None],
    tuple[tuple[Array, dict[str, Array]], LanguageModel],
]
# ``(trainable, frozen, batch) -> (mean float32 gradients, mean metrics)``.
Accumulate = Callable[[PyTree, PyTree, Batch], tuple[PyTree, dict[str, Array]]]


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    config: StepConfig,
    gradients: Accumulate,
) -> tuple[TrainState, dict[str, Array]]:
    """One optimizer step (not jitted) with the mean gradients and metrics over the batch's
    ``G`` accumulation steps that ``gradients`` gives (`accumulated_gradients` of a loss;
    `step_gradients` for the pipelined one).

    A step whose loss or gradient norm is not finite leaves the whole state as it was
    (``metrics["skipped"] == 1``): ``state.step`` counts applied updates, like the optimizer's
    own schedule counter, so the reported learning rate is the one the next update uses.

    The skip is a `jax.lax.cond` around the update, not a select between the new and the old
    state: a select keeps every old moment alive beside its new value, so XLA:CPU copied
    the moments of each large parameter (the ``(embed, vocab)`` head's at the peak of a
    big-vocabulary step), where the branch updates the donated state in place.
    """
    optimizer = build_optimizer(config.optimizer)
    trainable, frozen = split_trainable(state.model, config.optimizer)
    grad_mean, metrics = gradients(trainable, frozen, batch)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grad_mean, trainable)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)

    def update(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def keep(grads, opt_state, params):
        return params, opt_state

    updated, opt_state = jax.lax.cond(finite, update, keep, grads, state.opt_state, trainable)
    metrics.update(
        grad_norm=grad_norm,
        learning_rate=learning_rate_schedule(config.optimizer)(state.step),
        tokens=jnp.asarray(batch["tokens"].size, jnp.int32),
        skipped=jnp.logical_not(finite).astype(jnp.int32),
    )
    if "expert_fraction" in metrics:
        balanced = balance_buffers(
            frozen, metrics["expert_fraction"], config.loss.bias_update_rate, config.schedule
        )
        frozen = jax.tree.map(lambda new, old: jnp.where(finite, new, old), balanced, frozen)
    new_state = TrainState(
        step=state.step + finite.astype(state.step.dtype),
        model=eqx.combine(updated, frozen),
        opt_state=opt_state,
    )
    return new_state, metrics


def accumulated_gradients(
    trainable: PyTree,
    frozen: PyTree,
    batch: Batch,
    *,
    config: StepConfig,
    loss_fn: LossFn,
    loss_and_grad_fn: LossAndGradFn | None = None,
) -> tuple[PyTree, dict[str, Array]]:
    """The gradients of the ``trainable`` part of the model (float32) and the metrics, each
    the mean over the batch's ``G`` accumulation steps (`train_step`), with the batch's
    ``target_tokens`` and ``masked_fraction``.

    Every accumulation step's per-token loss terms are sums over its target tokens divided by
    ``1 / G`` of the whole batch's target count (over the slices too, where each slice runs
    this on its own: ``1 / (G S)``), so that the mean over the steps (and slices) is the sum
    over every target token of the batch divided by their number
    (`eqxzoo.train.loss`), whatever share of them each step holds."""
    n_accum = batch["tokens"].shape[0]
    count, slices = target_count(batch["targets"]), 1
    if config.slice_axes:  # inside `per_slice`: the whole batch's count, a share per slice
        count = jax.lax.psum(count, config.slice_axes)
        slices = jax.lax.psum(1, config.slice_axes)
    normalizer = jnp.maximum(count, 1.0) / (n_accum * slices)

    def microbatch_grads(carry, micro):
        grad_sum, metric_sum = carry

        inputs = (micro["tokens"], micro["targets"], normalizer, batch_documents(micro))

        def loss_of(trainable):
            return loss_fn(eqx.combine(trainable, frozen), *inputs)

        if loss_and_grad_fn is None:
            (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        else:
            (loss, metrics), grads = loss_and_grad_fn(eqx.combine(trainable, frozen), *inputs)
            grads, _ = eqx.partition(grads, trainable_mask(grads, config.optimizer.freeze))
        metrics = {"loss": loss, **metrics}
        if grad_sum is None:
            return (jax.tree.map(lambda g: g.astype(jnp.float32), grads), metrics), None
        return (
            jax.tree.map(jnp.add, grad_sum, grads),
            jax.tree.map(jnp.add, metric_sum, metrics),
        ), None

    def first_metrics():
        model = eqx.combine(trainable, frozen)
        first = jax.tree.map(lambda x: x[0], batch)
        loss, metrics = loss_fn(
            model, first["tokens"], first["targets"], normalizer, batch_documents(first)
        )
        return {"loss": loss, **metrics}

    if n_accum == 1:
        # No sums to start from zero, so no trace of the loss for its metrics' shapes.
        (grad_sum, metric_sum), _ = microbatch_grads(
            (None, None), jax.tree.map(lambda x: x[0], batch)
        )
    else:
        zeros = (
            jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), trainable),
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(first_metrics)),
        )
        (grad_sum, metric_sum), _ = jax.lax.scan(microbatch_grads, zeros, batch)
    grad_mean, metrics = jax.tree.map(lambda x: x / n_accum, (grad_sum, metric_sum))
    metrics.update(
        target_tokens=count.astype(jnp.int32),
        masked_fraction=1.0 - count / (batch["targets"].size * slices),
    )
    return grad_mean, metrics


def per_slice(accumulate: Accumulate, mesh: Mesh, config: StepConfig) -> Accumulate:
    """``accumulate`` run by each slice on its own sequences: a region manual over
    `StepConfig.slice_axes`, inside which the step sees the mesh without them
    (`StepConfig.within_slice`). Each slice's gradients and metrics leave the region along a
    leading axis split over the slices and are averaged there: the only values that cross
    slices, once a step, however many accumulation steps, microbatches, ticks or loss chunks
    the step takes.

    Inside, `check_vma` is off, so the gradients are each slice's own (a varying-value cast
    would sum them at every pipeline call), and the loss averages its router statistics over
    the slices itself (`eqxzoo.train.loss.over_slices`). The weights, and the gradients on
    their way out, are whole over ``dp`` within the region (`layout_within_slice`).
    """
    slice_axes = config.slice_axes
    by_slice = PartitionSpec(None, None, slice_axes)

    def run(trainable, frozen, batch):
        shardings = layout_within_slice(eqx.combine(trainable, frozen), config)
        trainable, frozen = (
            jax.lax.with_sharding_constraint(part, _like(part, shardings))
            for part in (trainable, frozen)
        )
        grads, metrics = accumulate(trainable, frozen, batch)
        grads = jax.lax.with_sharding_constraint(grads, _like(grads, shardings))
        return jax.tree.map(lambda x: x[None], (grads, metrics))

    def averaged(trainable, frozen, batch):
        each_slice = jax.shard_map(
            run,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec(), by_slice),
            out_specs=PartitionSpec(slice_axes),
            axis_names=set(slice_axes),
            check_vma=False,
        )(trainable, frozen, batch)
        return jax.tree.map(lambda x: jnp.mean(x, axis=0), each_slice)

    return averaged


def layout_within_slice(model: LanguageModel, config: StepConfig) -> PyTree[NamedSharding]:
    """Where `per_slice`'s region holds each array of ``model`` (pipeline layout): split as
    the rules split it within the slice, except over ``dp``. Inside a region manual over
    the slices, XLA's partitioner fails a check (spmd_partitioner_util.cc, "num_replica_groups
    * num_devices_per_group") on weights or gradients split over ``dp`` within the slice
    (FSDP) next to the pipeline's own shard_map, and on an embedding lookup whose table is
    split along ``embed``. So FSDP gathers each weight within the slice once a step, where
    it enters the region, and splits its gradient (reduced within the slice) again where it
    leaves."""
    mesh = jax.sharding.get_abstract_mesh()
    within = config.within_slice().rules
    rules = {
        name: tuple(axis for axis in rule_axes(name, within) if axis != DP_WITHIN_SLICE)
        for name in within
    }
    plain = eqx.filter_eval_shape(from_pipeline_layout, model, config.schedule)
    axes = pipeline_model_axes(plain)
    return jax.tree.map(
        lambda a, leaf: NamedSharding(mesh, partition_spec(a, leaf.shape, mesh, rules)),
        axes,
        model,
        is_leaf=lambda x: isinstance(x, Axes),
    )


def _like(part: PyTree, whole: PyTree) -> PyTree:
    """``whole``'s leaves where ``part`` (a part of the same model, None elsewhere) has one."""
    return jax.tree.map(
        lambda leaf, value: None if leaf is None else value, part, whole, is_leaf=_is_none
    )


def _is_none(x) -> bool:
    return x is None


def balance_buffers(
    model: PyTree, expert_fraction: Float[Array, "layers experts"], rate: float, schedule: Schedule
) -> PyTree:
    """``model`` with every balancing bias (`eqxzoo.nn.parameters.is_buffer`) moved by
    `eqxzoo.nn.balance_selection_bias` from this step's per-layer expert load.

    The biases are stacked like the blocks: ``(layers, experts)`` in layer order, or staged
    by ``schedule`` ``(repeats, stages, layers per stage, experts)``, where the load (in layer
    order) is staged the same way (`eqxzoo.parallel.stage_layers`: ``zb_v`` places its chunks
    in a V), so each layer's load lines up with its bias.
    """

    def balance(path, leaf):
        if leaf is None or not is_buffer(path):
            return leaf
        load = expert_fraction
        if leaf.shape != load.shape:
            load = stage_layers(load, schedule)
        return balance_selection_bias(leaf, load, rate)

    return jax.tree_util.tree_map_with_path(balance, model)


def batch_sharding(mesh: Mesh, rules: Mapping[str, MeshAxes] = DEFAULT_RULES) -> NamedSharding:
    """How ``(G, M, B, T)`` batches are split: by the rules of their logical axes (``B``
    over ``dp`` and ``ep``, ``T`` over ``cp``)."""
    return activation_sharding(mesh, "grad_accum", "microbatches", "batch", "seq", rules=rules)


def abstract_batch(
    mesh: Mesh,
    rules: Mapping[str, MeshAxes],
    batch_shape: tuple[int, int, int, int],
    documents: bool,
) -> dict[str, jax.ShapeDtypeStruct]:
    """A ``(G, M, B, T)`` batch as shape structs with its sharding: tokens and targets, and
    with ``documents`` their `DOCUMENT_FIELDS`."""
    sharding = batch_sharding(mesh, rules)
    names = ("tokens", "targets", *(DOCUMENT_FIELDS if documents else ()))
    return {name: jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=sharding) for name in names}


def compile_train_step(
    config: StepConfig,
    mesh: Mesh,
    state: TrainState,
    batch_shape: tuple[int, int, int, int],
    *,
    documents: bool = False,
    refuse_deadlocks: bool = True,
) -> jax.stages.Compiled:
    """`make_train_step` compiled for ``state`` (arrays or `jax.ShapeDtypeStruct` leaves) and
    ``(G, M, B, T)`` batches (of packed documents, with their `DOCUMENT_FIELDS`, where
    ``documents``), without running it: the run checks its memory analysis before
    initialising anything, then calls it (the state and batch must match exactly). A step
    XLA:CPU would hang in is refused (`check_no_permutes_in_branches`) unless
    ``refuse_deadlocks`` is off: the planner compiles plans only to read their figures."""
    batch = abstract_batch(mesh, config.rules, batch_shape, documents)
    compiled = make_train_step(config, mesh).lower(state, batch).compile()
    if refuse_deadlocks:
        check_no_permutes_in_branches(compiled, mesh)
    return compiled


def compile_train_step_for(
    config: StepConfig,
    mesh: Mesh,
    state: TrainState,
    batch_shape: tuple[int, int, int, int],
    *,
    documents: bool = False,
    verdicts: Path | None = None,
) -> tuple[jax.stages.Compiled, StepConfig]:
    """`compile_train_step`, and the `StepConfig` it compiled with: where XLA:CPU could not
    run the step (`PlanWouldDeadlock`) and the schedule allows it (GPipe, circular), the
    stages compute through their bubbles instead of skipping them (``skip_bubbles=False``:
    the bubbles' share of the stage work more, the same results). Build every other step
    of the run (evaluation) from the returned config.

    A refusal is remembered in ``verdicts`` (`bubble_verdicts`), a file named by everything
    the compiled program depends on: a rerun of the plan (a resume, the same config again)
    compiles the step that computes through its bubbles straight away, without first
    tracing, lowering and compiling the one XLA:CPU refuses. Only refusals are kept: a step
    that skips its bubbles is always checked, so a stale file can cost a bubble's compute,
    never a hang."""
    verdict = None
    if verdicts is not None and config.skip_bubbles and not config.schedule.fuses_backward:
        verdict = verdicts / _program_key(config, mesh, state, batch_shape, documents)
    if verdict is None or not verdict.exists():
        try:
            return compile_train_step(config, mesh, state, batch_shape, documents=documents), config
        except PlanWouldDeadlock:
            if config.schedule.fuses_backward or not config.skip_bubbles:
                raise
        if verdict is not None:
            _remember(verdict)
    config = dataclasses.replace(config, skip_bubbles=False)
    return compile_train_step(config, mesh, state, batch_shape, documents=documents), config


def bubble_verdicts() -> Path | None:
    """Where `compile_train_step_for` remembers refused steps: beside JAX's persistent
    compilation cache (None when that cache is off)."""
    cache = jax.config.jax_compilation_cache_dir
    return Path(cache) / "eqxzoo-bubble-verdicts" if cache else None


def _program_key(
    config: StepConfig,
    mesh: Mesh,
    state: TrainState,
    batch_shape: tuple[int, int, int, int],
    documents: bool,
) -> str:
    """A hash of what the compiled step depends on: versions, platform, mesh, step config,
    the state's structure, shapes, dtypes and shardings, and the batch's shape and fields."""
    leaves, structure = jax.tree.flatten(state)
    described = repr(
        (
            jax.__version__,
            jaxlib.__version__,
            [(device.platform, device.device_kind) for device in mesh.devices.flat[:1]],
            dict(mesh.shape),
            config,
            batch_shape,
            documents,
            structure,
            [(leaf.shape, leaf.dtype, getattr(leaf, "sharding", None)) for leaf in leaves],
        )
    )
    return hashlib.sha256(described.encode()).hexdigest()


def _remember(verdict: Path) -> None:
    """Create ``verdict`` (written aside under a name of this process's own, then renamed:
    the processes of a run may write it at once). Best effort: a disk that cannot take it
    costs the next run the refused compile again, nothing else."""
    try:
        verdict.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=verdict.parent, delete=False) as partial:
            partial.write("skip_bubbles=False\n")
        os.replace(partial.name, verdict)
    except OSError:
        pass


class PlanWouldDeadlock(UserError, RuntimeError):
    """The compiled step would hang on this platform (and abort after XLA's timeout)."""


def check_no_permutes_in_branches(compiled: jax.stages.Compiled, mesh: Mesh) -> None:
    """Refuse, on XLA:CPU with pipeline stages, a step whose partitioner placed
    collective-permutes inside the pipeline's bubble-skipping branch
    (`eqxzoo.parallel.collectives.permutes_in_branches`): there every device must arrive,
    and the stages idling in a bubble never do. The partitioner did so where it moved a
    weight between mesh axes (latent attention with ``dp`` and ``tp`` or ``ep`` above 1)
    while ``dp`` was its own in the region; with the region manual over the batch's axes
    (`eqxzoo.parallel.pipeline.auto_batch_axes`) no model of the zoo is known to."""
    if mesh.devices.flat[0].platform != "cpu" or mesh.shape["pp"] == 1:
        return
    permutes = permutes_in_branches(compiled.as_text())
    if permutes:
        raise PlanWouldDeadlock(
            f"this plan would hang on XLA:CPU: the partitioner put {len(permutes)} "
            f"collective-permute(s) inside the pipeline's stage branch (first: "
            f"{permutes[0]}), where devices of stages idling in a bubble never arrive; on "
            "CPU, choose a mesh with fewer of dp, tp and ep above 1, pp = 1, or the gpipe or "
            "circular schedule (which then compute through their bubbles)"
        )


def step_gradients(config: StepConfig, mesh: Mesh) -> Accumulate:
    """The train step's `accumulated_gradients`: of `pipelined_loss` by autodiff, or of the
    1F1B-family executor's own backward (`pipelined_loss_and_grad`) where the schedule
    runs one; each slice on its own where ``dp`` spans slices (`per_slice`: inside, the
    losses see the region's mesh and `StepConfig.within_slice`)."""
    inner = config.within_slice()

    def region_mesh():
        return jax.sharding.get_abstract_mesh() if config.slice_axes else mesh

    def loss_fn(model, tokens, targets, normalizer, documents):
        return pipelined_loss(
            model,
            tokens,
            targets,
            config=inner,
            mesh=region_mesh(),
            normalizer=normalizer,
            documents=documents,
        )

    def loss_and_grad_fn(model, tokens, targets, normalizer, documents):
        return pipelined_loss_and_grad(
            model,
            tokens,
            targets,
            config=inner,
            mesh=region_mesh(),
            normalizer=normalizer,
            documents=documents,
        )

    accumulate = functools.partial(
        accumulated_gradients,
        config=config,
        loss_fn=loss_fn,
        loss_and_grad_fn=loss_and_grad_fn if config.schedule.fuses_backward else None,
    )
    if not config.slice_axes:
        return accumulate
    return per_slice(accumulate, mesh, config)


def make_train_step(
    config: StepConfig, mesh: Mesh
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Array]]]:
    """The jitted pipelined train step; the incoming state is donated.

    The batch is constrained to `batch_sharding` inside the step, so a batch that arrives
    unsharded is still split over ``dp`` rather than computed in full on every replica.
    """

    gradients = step_gradients(config, mesh)

    def step(state, batch):
        batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh, config.rules))
        state, metrics = train_step(
            state,
            batch,
            config=config,
            gradients=gradients,
        )
        # Replicated, so that every process can read them (multi-process runs).
        replicated = activation_sharding(mesh, rules=config.rules)
        return state, jax.lax.with_sharding_constraint(metrics, replicated)

    return jax.jit(step, donate_argnums=0)


def make_eval_step(
    config: StepConfig, mesh: Mesh
) -> Callable[[LanguageModel, Batch], Float[Array, ""]]:
    """The jitted evaluation: cross-entropy of a ``(1, M, B, T)`` batch's target tokens (their
    mean) through the same pipeline as training (``model`` in the pipeline layout)."""

    def evaluate(model, batch):
        batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh, config.rules))
        first = jax.tree.map(lambda x: x[0], batch)
        _, metrics = pipelined_loss(
            model,
            first["tokens"],
            first["targets"],
            config=config,
            mesh=mesh,
            documents=batch_documents(first),
        )
        return metrics["cross_entropy"]

    return jax.jit(evaluate, out_shardings=activation_sharding(mesh, rules=config.rules))


def compile_eval_step(
    config: StepConfig,
    mesh: Mesh,
    model: LanguageModel,
    batch_shape: tuple[int, int, int, int],
    *,
    documents: bool = False,
) -> jax.stages.Compiled:
    """`make_eval_step` compiled for ``model`` (arrays or `jax.ShapeDtypeStruct` leaves, the
    pipeline layout) and ``(1, M, B, T)`` batches (with `DOCUMENT_FIELDS` where
    ``documents``), checked as the train step is (`check_no_permutes_in_branches`): where
    XLA:CPU could not skip the pipeline's bubbles in this program (its sharding differs from
    the train step's: adapters, say), its stages compute through them instead."""
    batch = abstract_batch(mesh, config.rules, batch_shape, documents)

    def compiled(skip_bubbles: bool) -> jax.stages.Compiled:
        evaluate = make_eval_step(dataclasses.replace(config, skip_bubbles=skip_bubbles), mesh)
        return evaluate.lower(model, batch).compile()

    step = compiled(config.skip_bubbles)
    if config.skip_bubbles:
        try:
            check_no_permutes_in_branches(step, mesh)
        except PlanWouldDeadlock:
            step = compiled(False)
    return step
