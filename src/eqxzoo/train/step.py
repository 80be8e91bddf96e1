"""The training step: gradient accumulation over ``G`` pipelined losses, then a filtered
optax update with a global-norm clip; the evaluation step.

`make_train_step` returns the jitted step ``(state, batch) -> (state, metrics)`` with the old
state donated. The state (`eqxzoo.train.state`), its layouts (`eqxzoo.train.layout`) and the
loss (`eqxzoo.train.loss`) live in their own modules; this one depends on the model only
through the model contract.
"""

import dataclasses
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
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Float, Int, PyTree

from eqxzoo.errors import UserError
from eqxzoo.nn import LanguageModel, balance_selection_bias
from eqxzoo.nn.parameters import is_buffer
from eqxzoo.optim import build_optimizer, learning_rate_schedule, trainable_mask
from eqxzoo.parallel import DEFAULT_RULES, MeshAxes, Schedule, activation_sharding, stage_layers
from eqxzoo.parallel.collectives import permutes_in_branches
from eqxzoo.train.loss import pipelined_loss, pipelined_loss_and_grad
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import TrainState, split_trainable

Batch = dict[str, Int[Array, "grad_accum microbatches batch seq"]]

LossFn = Callable[[LanguageModel, Array, Array], tuple[Array, dict[str, Array]]]
# ``(model, tokens, targets) -> ((loss, metrics), grads)``, grads shaped like the model.
LossAndGradFn = Callable[
    [LanguageModel, Array, Array], tuple[tuple[Array, dict[str, Array]], LanguageModel]
]


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    config: StepConfig,
    loss_fn: LossFn,
    loss_and_grad_fn: LossAndGradFn | None = None,
) -> tuple[TrainState, dict[str, Array]]:
    """One optimizer step over ``G`` accumulated gradients of ``loss_fn`` (not jitted); a
    schedule that runs its own backward gives them through ``loss_and_grad_fn`` instead.

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

    def microbatch_grads(carry, micro):
        grad_sum, metric_sum = carry

        def loss_of(trainable):
            return loss_fn(eqx.combine(trainable, frozen), micro["tokens"], micro["targets"])

        if loss_and_grad_fn is None:
            (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        else:
            (loss, metrics), grads = loss_and_grad_fn(
                eqx.combine(trainable, frozen), micro["tokens"], micro["targets"]
            )
            grads, _ = eqx.partition(grads, trainable_mask(grads, config.optimizer.freeze))
        metrics = {"loss": loss, **metrics}
        if grad_sum is None:
            return (jax.tree.map(lambda g: g.astype(jnp.float32), grads), metrics), None
        return (
            jax.tree.map(jnp.add, grad_sum, grads),
            jax.tree.map(jnp.add, metric_sum, metrics),
        ), None

    def first_metrics():
        loss, metrics = loss_fn(state.model, batch["tokens"][0], batch["targets"][0])
        return {"loss": loss, **metrics}

    if batch["tokens"].shape[0] == 1:
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
    n_accum = batch["tokens"].shape[0]
    grads = jax.tree.map(lambda g, p: (g / n_accum).astype(p.dtype), grad_sum, trainable)
    metrics = jax.tree.map(lambda m: m / n_accum, metric_sum)
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
    over ``dp``)."""
    return activation_sharding(mesh, "grad_accum", "microbatches", "batch", "seq", rules=rules)


def compile_train_step(
    config: StepConfig, mesh: Mesh, state: TrainState, batch_shape: tuple[int, int, int, int]
) -> jax.stages.Compiled:
    """`make_train_step` compiled for ``state`` (arrays or `jax.ShapeDtypeStruct` leaves) and
    ``(G, M, B, T)`` batches, without running it: the run checks its memory analysis before
    initialising anything, then calls it (the state and batch must match exactly)."""
    sharding = batch_sharding(mesh, config.rules)
    batch = {
        name: jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=sharding)
        for name in ("tokens", "targets")
    }
    compiled = make_train_step(config, mesh).lower(state, batch).compile()
    check_no_permutes_in_branches(compiled, mesh)
    return compiled


def compile_train_step_for(
    config: StepConfig,
    mesh: Mesh,
    state: TrainState,
    batch_shape: tuple[int, int, int, int],
    *,
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
        verdict = verdicts / _program_key(config, mesh, state, batch_shape)
    if verdict is None or not verdict.exists():
        try:
            return compile_train_step(config, mesh, state, batch_shape), config
        except PlanWouldDeadlock:
            if config.schedule.fuses_backward or not config.skip_bubbles:
                raise
        if verdict is not None:
            _remember(verdict)
    config = dataclasses.replace(config, skip_bubbles=False)
    return compile_train_step(config, mesh, state, batch_shape), config


def bubble_verdicts() -> Path | None:
    """Where `compile_train_step_for` remembers refused steps: beside JAX's persistent
    compilation cache (None when that cache is off)."""
    cache = jax.config.jax_compilation_cache_dir
    return Path(cache) / "eqxzoo-bubble-verdicts" if cache else None


def _program_key(
    config: StepConfig, mesh: Mesh, state: TrainState, batch_shape: tuple[int, int, int, int]
) -> str:
    """A hash of what the compiled step depends on: versions, platform, mesh, step config,
    the state's structure, shapes, dtypes and shardings, and the batch's shape."""
    leaves, structure = jax.tree.flatten(state)
    described = repr(
        (
            jax.__version__,
            jaxlib.__version__,
            [(device.platform, device.device_kind) for device in mesh.devices.flat[:1]],
            dict(mesh.shape),
            config,
            batch_shape,
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
    and the stages idling in a bubble never do. Which sharding choices make the partitioner
    move a weight between mesh axes by permutes depends on the model (latent attention
    with both ``dp`` and ``tp`` above 1 does)."""
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


def make_train_step(
    config: StepConfig, mesh: Mesh
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Array]]]:
    """The jitted pipelined train step; the incoming state is donated.

    The batch is constrained to `batch_sharding` inside the step, so a batch that arrives
    unsharded is still split over ``dp`` rather than computed in full on every replica.
    """

    def loss_fn(model, tokens, targets):
        return pipelined_loss(model, tokens, targets, config=config, mesh=mesh)

    loss_and_grad_fn = None
    if config.schedule.fuses_backward:

        def loss_and_grad_fn(model, tokens, targets):
            return pipelined_loss_and_grad(model, tokens, targets, config=config, mesh=mesh)

    def step(state, batch):
        batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh, config.rules))
        state, metrics = train_step(
            state, batch, config=config, loss_fn=loss_fn, loss_and_grad_fn=loss_and_grad_fn
        )
        # Replicated, so that every process can read them (multi-process runs).
        replicated = activation_sharding(mesh, rules=config.rules)
        return state, jax.lax.with_sharding_constraint(metrics, replicated)

    return jax.jit(step, donate_argnums=0)


def make_eval_step(
    config: StepConfig, mesh: Mesh
) -> Callable[[LanguageModel, Batch], Float[Array, ""]]:
    """The jitted evaluation: token-mean cross-entropy of a ``(1, M, B, T)`` batch through the
    same pipeline as training (``model`` in the pipeline layout)."""

    def evaluate(model, batch):
        batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh, config.rules))
        _, metrics = pipelined_loss(
            model, batch["tokens"][0], batch["targets"][0], config=config, mesh=mesh
        )
        return metrics["cross_entropy"]

    return jax.jit(evaluate, out_shardings=activation_sharding(mesh, rules=config.rules))
