"""The pipeline executor: runs a `Schedule` table over stacked layers under `jax.shard_map`.

The stacked layers are kept in the ``[R, P, k]`` layout (``stage_layers``), sharded over
``pp`` on the ``P`` axis. Inside one `jax.shard_map` that is manual over ``pp`` (and ``cp``
where each sequence is split over it, ``ep`` where the experts are: `pipeline_axes`; the
other mesh axes stay with the compiler), a `jax.lax.scan` runs the schedule's ticks; at each
tick every stage looks up its entry in the table, runs its ``k`` layers of the scheduled
repeat on its input (bubble entries are skipped with `jax.lax.cond` and contribute nothing),
and `jax.lax.ppermute` shifts the outputs one stage on. Stage 0 takes fresh microbatches on
the first repeat and the last stage's returning outputs (kept in a per-microbatch buffer) on
later ones; the last stage collects outputs on the last repeat. The stage body is
rematerialised around the `cond`, so only each tick's input is saved for the backward pass.
"""

from collections.abc import Callable, Mapping
from typing import NamedTuple

import einops
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import Array, Float, PyTree

from eqxzoo.nn import Axes, Documents, apply_layers, logical_axes
from eqxzoo.nn.moe import dispatches_by_sort, expert_split_axes
from eqxzoo.nn.stack import RematPolicy
from eqxzoo.nn.varying import varying_axes
from eqxzoo.parallel.mesh import check_stage_loops
from eqxzoo.parallel.rules import (
    DEFAULT_RULES,
    MeshAxes,
    activation_sharding,
    activation_spec,
    manual_spec,
    rule_axes,
)
from eqxzoo.parallel.schedule import Schedule


def stage_layers(layers: PyTree, schedule: Schedule) -> PyTree:
    """Stacked layers ``(L, ...)`` as ``(R, P, L / (P R), ...)``: chunk ``r`` of stage ``p``
    holds the layers of the virtual stage the schedule places there
    (`Schedule.virtual_stages`; a reshape for the looped placement, a gather for ``zb_v``)."""
    placement = schedule.virtual_stages
    looped = bool((placement.ravel() == np.arange(placement.size)).all())

    def view(array):
        assert array.shape[0] % placement.size == 0, (array.shape, placement.shape)
        chunks = einops.rearrange(array, "(v k) ... -> v k ...", v=placement.size)
        if not looped:
            chunks = chunks[placement.ravel()]
        return chunks.reshape(*placement.shape, *chunks.shape[1:])

    return jax.tree.map(view, layers)


def unstage_layers(layers: PyTree, schedule: Schedule) -> PyTree:
    """Inverse of `stage_layers`: ``(R, P, k, ...)`` back to ``(L, ...)`` in layer order."""
    order = np.argsort(schedule.virtual_stages, axis=None)  # virtual stage -> chunk
    looped = bool((order == np.arange(order.size)).all())

    def plain(array):
        chunks = einops.rearrange(array, "r p k ... -> (r p) k ...")
        if not looped:
            chunks = chunks[order]
        return einops.rearrange(chunks, "v k ... -> (v k) ...")

    return jax.tree.map(plain, layers)


def restage_layers(layers: PyTree, source: Schedule, target: Schedule) -> PyTree:
    """Staged ``layers`` of ``source``'s placement in ``target``'s (the same arrays when both
    place alike; across devices a permutation of the chunks that move)."""
    if np.array_equal(source.virtual_stages, target.virtual_stages):
        return layers
    return stage_layers(unstage_layers(layers, source), target)


def staged_axes(axes: PyTree[Axes]) -> PyTree[Axes]:
    """Logical axes of staged layers: the leading ``layers`` becomes ``repeats, stages, layers``."""

    def restage(a: Axes) -> Axes:
        assert a.names[0] == "layers", a
        return Axes(("repeats", "stages", "layers", *a.names[1:]))

    return jax.tree.map(restage, axes, is_leaf=lambda x: isinstance(x, Axes))


def transport_dtype(compute_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype activations and their cotangents cross stages in: float32 where the compute
    dtype is narrower (XLA:CPU fails to compile the pipeline's bfloat16 collectives, "Invalid
    binary instruction opcode copy"), which the planner prices."""
    return jnp.promote_types(compute_dtype, jnp.float32)


def run_pipeline(
    layers: PyTree,
    microbatches: Float[Array, "microbatches batch seq embed"],
    *,
    documents: Documents | None = None,
    schedule: Schedule,
    mesh: Mesh | AbstractMesh,
    remat_policy: RematPolicy = "none",
    remat_stages: bool = True,
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
    bubble_fill: float = 0.0,
    skip_bubbles: bool = True,
) -> tuple[Float[Array, "microbatches batch seq embed"], dict[str, Array]]:
    """Apply staged ``layers`` to every microbatch, stage by stage on the ``pp`` mesh axis.

    ``layers`` are stacked layers in ``schedule``'s `stage_layers` layout (``zb_v``'s are
    moved to the looped placement first: the forward runs ``circular``); each layer is called as
    ``layer(h, key=None) -> (h, aux)`` on a whole microbatch ``(batch, seq, embed)`` (the zoo's
    layers treat leading axes as independent sequences and average their aux values), with
    ``documents=`` the microbatch's packed documents where ``documents`` (leading axis: the
    microbatches) is given: every stage holds them all and picks its microbatch's.

    Returns the outputs (same shape as ``microbatches``) and every layer's aux values for
    every microbatch, shape ``(microbatches, L, ...)`` in layer order. With one stage (no
    shard_map) the stage's input and output are constrained to the ``batch`` rule of
    ``rules``, so that the compiler keeps data parallelism instead of gathering the batch to
    match FSDP-sharded weights; on several stages, and on one where experts dispatch
    (`pools_one_stage`), the region is manual over the batch's axes (`auto_batch_axes`).
    ``remat_stages=False`` keeps every
    tick's activations instead of recomputing them (faster, more memory). ``bubble_fill`` is
    what a skipped tick emits (tests fill bubbles with NaN to show nothing leaks from them).
    ``skip_bubbles=False`` computes the stage at every tick, on zeros in a bubble, and keeps
    the result only where the tick is active: no ``cond``, so every device reaches every
    collective of the stage (XLA:CPU needs it when the partitioner puts collective-permutes
    in the stage; `eqxzoo.train.step.compile_train_step_for`).
    """
    assert mesh.shape["pp"] == schedule.stages, (mesh.shape, schedule)  # checked by the state
    check_stage_loops(layers, mesh)
    placed_by, schedule = schedule, schedule.forward_only
    # With one stage there is nothing to shift: run the same table without a shard_map over
    # pp (XLA's partitioner rejects the autodiff all-reduce over a size-1 manual pp axis
    # next to dp).
    pipelined = schedule.stages > 1
    region = RegionAxes.of(mesh, layers, rules, pipelined=pipelined)
    manual_axes = region.manual
    manual = bool(manual_axes)
    # Layers still compute in the microbatches' dtype.
    compute_dtype = microbatches.dtype
    if pipelined:
        microbatches = microbatches.astype(transport_dtype(compute_dtype))
    params, static = eqx.partition(layers, eqx.is_array)
    params = restage_layers(params, placed_by, schedule)
    schedule_table = schedule.table()
    table = {name: jnp.asarray(values) for name, values in schedule_table.items()}
    # One stage has no bubble: a conditional there would only be a branch never taken (whose
    # output the partitioner may shard otherwise than the stage's: XLA rejects that).
    has_bubbles = not bool(np.all(schedule_table["active"]))
    n_stages, n_repeats = schedule.stages, schedule.repeats
    last_stage = n_stages - 1
    shift = [(stage, (stage + 1) % n_stages) for stage in range(n_stages)]

    split_batch = batch_split(mesh, region, rules)

    def stage_compute(stage_params, h, documents):
        h_out, aux = apply_layers(
            eqx.combine(stage_params, static),
            split_batch(h).astype(compute_dtype),
            documents=documents,
            remat_policy=remat_policy,
        )
        return split_batch(h_out).astype(h.dtype), aux

    def run_stage(stage_params, h, documents):
        return varying_over(stage_compute(stage_params, h, documents), manual_axes)

    def per_stage(stage_params, inputs, documents):
        stage = jax.lax.axis_index("pp") if pipelined else 0
        # Used by every shard of the sequence (cp): their gradient is summed once, here.
        stage_params = varying_over(jax.tree.map(lambda p: p[:, 0], stage_params), manual_axes)
        # Likewise the microbatches every stage holds (stage 0 reads them): their gradient
        # is summed over the stages once, not at every tick.
        inputs = varying_over(inputs, manual_axes)
        # Traced here, where the layers see the region's axes (a shard of each sequence).
        first_documents = None if documents is None else documents[0]
        _, aux_shapes = jax.eval_shape(
            stage_compute, jax.tree.map(lambda p: p[0], stage_params), inputs[0], first_documents
        )

        def skip_stage(stage_params, h, documents):
            del stage_params, documents
            aux = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shapes)
            return varying_over((jnp.full_like(h, bubble_fill), aux), manual_axes)

        def tick(carry, t):
            received, returning, outputs, aux_sums = carry
            active = table["active"][t, stage]
            microbatch = table["microbatch"][t, stage]
            repeat = table["repeat"][t, stage]
            first_input = inputs[microbatch]
            if n_repeats > 1:
                first_input = jnp.where(repeat == 0, first_input, returning[microbatch])
            h_in = jnp.where(stage == 0, first_input, received)

            # The repeat's weights are picked inside the checkpoint: what it saves for the
            # backward pass is then the whole (loop-invariant) stage and a scalar, not a copy
            # of the picked weights for every tick.
            def stage_or_bubble(w, r, h, documents):
                w = jax.tree.map(lambda p: p[r], w)
                if not has_bubbles:
                    return run_stage(w, h, documents)
                if skip_bubbles:
                    with jax.named_scope(STAGE_SCOPE):
                        return jax.lax.cond(active, run_stage, skip_stage, w, h, documents)
                computed = run_stage(w, jnp.where(active, h, jnp.zeros_like(h)), documents)
                return jax.tree.map(
                    lambda value, skipped: jnp.where(active, value, skipped),
                    computed,
                    skip_stage(w, h, documents),
                )

            if remat_stages:
                stage_or_bubble = jax.checkpoint(stage_or_bubble, prevent_cse=False)
            microbatch_documents = None if documents is None else documents[microbatch]
            h_out, aux = stage_or_bubble(stage_params, repeat, h_in, microbatch_documents)
            aux_sums = jax.tree.map(lambda acc, v: acc.at[microbatch, repeat].add(v), aux_sums, aux)
            is_output = active & (stage == last_stage) & (repeat == n_repeats - 1)
            outputs = outputs.at[microbatch].set(jnp.where(is_output, h_out, outputs[microbatch]))
            received = jax.lax.ppermute(h_out, "pp", shift) if pipelined else h_out
            if n_repeats > 1:
                arriving = table["microbatch"][t, last_stage]
                keep = (
                    (stage == 0)
                    & table["active"][t, last_stage]
                    & (table["repeat"][t, last_stage] < n_repeats - 1)
                )
                returning = returning.at[arriving].set(
                    jnp.where(keep, received, returning[arriving])
                )
            return (received, returning, outputs, aux_sums), None

        zeros = jnp.zeros_like(inputs)
        init = (
            varying_over(jnp.zeros_like(inputs[0]), manual_axes),
            varying_over(zeros if n_repeats > 1 else jnp.zeros((), inputs.dtype), manual_axes),
            varying_over(zeros, manual_axes),
            jax.tree.map(
                lambda s: varying_over(
                    jnp.zeros((len(inputs), n_repeats, *s.shape), s.dtype), manual_axes
                ),
                aux_shapes,
            ),
        )
        if schedule.ticks == 1:
            (_, _, outputs, aux_sums), _ = tick(init, 0)
        else:
            (_, _, outputs, aux_sums), _ = jax.lax.scan(tick, init, jnp.arange(schedule.ticks))
        # The layers average their aux values over cp and ep; the means over the pooled
        # axes make them the whole batch's.
        data_axes = region.data
        aux_sums = jax.lax.pmean(aux_sums, data_axes) if data_axes else aux_sums
        return outputs[None], jax.tree.map(lambda v: v[None], aux_sums)

    def spec(*names):
        return manual_spec(*names, manual_axes=manual_axes, rules=rules)

    stage_spec = stage_specs(params, static, region.layers, rules)
    if region.auto_batch:
        microbatches = jax.lax.with_sharding_constraint(
            microbatches, activation_sharding(mesh, "microbatches", "batch", rules=rules)
        )
    if not manual:
        outputs, aux_sums = per_stage(params, microbatches, documents)
    else:
        per_microbatch = spec("microbatches", "batch", "seq")
        outputs, aux_sums = jax.shard_map(
            per_stage,
            mesh=mesh,
            in_specs=(stage_spec, per_microbatch, per_microbatch),
            out_specs=(spec("stages", "microbatches", "batch", "seq"), spec("stages")),
            axis_names=set(manual_axes),
            check_vma=True,
        )(params, microbatches, documents)
    layer_aux = jax.tree.map(lambda v: in_layer_order(v, schedule), aux_sums)
    return outputs[last_stage].astype(compute_dtype), layer_aux


CONTEXT_AXIS, EXPERT_AXIS = "cp", "ep"


def pipeline_axes(mesh: Mesh | AbstractMesh, layers: PyTree) -> tuple[str, ...]:
    """The mesh axes the pipeline's `jax.shard_map` is manual over: ``pp`` where there are
    stages to shift between, ``cp`` where the sequences are split (context parallelism: the
    layers' attention exchanges keys and values over it itself, `eqxzoo.nn.ContextSplit`),
    and ``ep`` where ``layers`` split their experts over it (each device holds its own
    tokens, and the MoE layers exchange them with the experts' devices themselves,
    `eqxzoo.nn.ExpertSplit`); none (no shard_map) on one stage of whole sequences."""
    split = {
        "pp": True,
        CONTEXT_AXIS: True,
        EXPERT_AXIS: EXPERT_AXIS in expert_split_axes(layers),
    }
    return tuple(axis for axis, used in split.items() if used and mesh.shape.get(axis, 1) > 1)


def batch_axes(mesh: Mesh | AbstractMesh, rules: Mapping[str, MeshAxes]) -> tuple[str, ...]:
    """The axes of more than one device the ``batch`` rule splits the sequences over."""
    return tuple(a for a in rule_axes("batch", rules) if mesh.shape.get(a, 1) > 1)


def auto_batch_axes(
    mesh: Mesh | AbstractMesh, layers: PyTree, rules: Mapping[str, MeshAxes]
) -> tuple[str, ...]:
    """The axes of more than one device the ``batch`` rule splits the sequences over, other
    than the `pipeline_axes` (dp; ep where ``layers`` do not split their experts over it).

    On several stages the pipeline's region is manual over them too, each device running
    its own sequences of each microbatch, and the weights are whole over them there
    (gathered once at the region's boundary, as MaxText's ``pipeline_fsdp_ag_once`` does;
    their gradients summed over them once, at its end). Left to the compiler, the batch's
    split did not survive into the region: every data-parallel device ran each stage on the
    whole microbatch (the 1F1B executor's ids enter replicated, as its partitioner fails on
    batch-split ids' gathers next to tp), and constraints inside the region aborted XLA's
    partitioner with tp or put collective-permutes into the action branches with ep. On one
    stage the compiler splits the batch over them (the layers' inputs constrained), and keeps
    FSDP's weights split there, but for layers whose experts dispatch their tokens
    (`pools_one_stage`)."""
    manual = pipeline_axes(mesh, layers)
    return tuple(a for a in batch_axes(mesh, rules) if a not in manual)


def pools_one_stage(layers: PyTree) -> bool:
    """Whether one stage's region is manual over the batch's axes too, as several stages'
    are: where ``layers`` route tokens to their experts by a sort of all of them
    (`eqxzoo.nn.moe.dispatches_by_sort`). The partitioner does not split such a sort over
    an automatic axis of the batch: it gathered the whole batch for every dispatch (tiny
    on dp8: 274 MiB a device; 68 MiB in a region manual over dp, its weights whole there)."""
    return dispatches_by_sort(layers)


class RegionAxes(NamedTuple):
    """The mesh axes of a pipeline's region: ``layers``, the `pipeline_axes` (pp, and cp and
    ep where the layers split over them); ``pooled``, the `auto_batch_axes` on several
    stages (and on one where `pools_one_stage`), where the region is manual over them too;
    ``auto_batch``, the same on one stage otherwise, which the compiler splits."""

    layers: tuple[str, ...]
    pooled: tuple[str, ...]
    auto_batch: tuple[str, ...]

    @classmethod
    def of(
        cls,
        mesh: Mesh | AbstractMesh,
        layers: PyTree,
        rules: Mapping[str, MeshAxes],
        *,
        pipelined: bool,
    ) -> "RegionAxes":
        batch = auto_batch_axes(mesh, layers, rules)
        pooled = pipelined or pools_one_stage(layers)
        return cls(pipeline_axes(mesh, layers), *((batch, ()) if pooled else ((), batch)))

    @property
    def manual(self) -> tuple[str, ...]:
        """The axes the region's `jax.shard_map` is manual over."""
        return self.layers + self.pooled

    @property
    def data(self) -> tuple[str, ...]:
        """The manual axes over which each device holds a shard of the batch's tokens
        (`shard_axes`, and the pooled ones): the loss and the gradients of what every shard
        uses are sums over them, the aux values (each shard's averages) means."""
        return shard_axes(self.layers) + self.pooled


def batch_split(
    mesh: Mesh | AbstractMesh, region: RegionAxes, rules: Mapping[str, MeshAxes]
) -> Callable[[Array], Array]:
    """A stage's activations constrained to the batch's split over the axes the compiler
    splits (`RegionAxes.auto_batch`: on one stage), so that it keeps data parallelism
    instead of gathering the batch to match FSDP-sharded weights; unchanged elsewhere."""
    if not region.auto_batch:
        return lambda h: h
    if region.manual:  # inside a region manual over cp or ep: a bare spec of the other axes
        spec = activation_spec("batch", rules={"batch": region.auto_batch})
        return lambda h: jax.lax.with_sharding_constraint(h, spec)
    sharding = activation_sharding(mesh, "batch", rules=rules)
    return lambda h: jax.lax.with_sharding_constraint(h, sharding)


def shard_axes(manual_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The manual axes over which each device holds a shard of the batch's tokens (``cp``:
    of each sequence; ``ep``: of the sequences): the loss and the gradients of what every
    shard uses are sums over them."""
    return tuple(axis for axis in (CONTEXT_AXIS, EXPERT_AXIS) if axis in manual_axes)


# Inside the pipeline's region only these logical axes are split over its manual axes: the
# stages, and the routed experts (each device computes its own). Every other axis a rule
# splits over a manual axis (FSDP over ep) is whole there, gathered at the region's boundary.
SPLIT_IN_REGION = ("repeats", "stages", "experts")
# The name scope of the conditional a stage skips its bubble ticks with (its forward's and,
# by autodiff, its backward's): its true branch runs on the table's active ticks only.
STAGE_SCOPE = "pipeline_stage"


def stage_specs(
    params: PyTree, static: PyTree, manual_axes: tuple[str, ...], rules: Mapping[str, MeshAxes]
) -> PyTree:
    """The `jax.shard_map` specs of staged layer arrays ``params`` (``(R, P, k, ...)``,
    `stage_layers`; ``static`` the rest of the layers) in the pipeline's region: split over
    the stages and the experts where ``manual_axes`` (the `pipeline_axes`) split them, whole
    over every other axis."""
    one_layer = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape[3:], p.dtype), params)
    axes = logical_axes(eqx.combine(one_layer, static))
    in_region = {
        name: tuple(a for a in rule_axes(name, rules) if a in manual_axes)
        for name in SPLIT_IN_REGION
    }
    return jax.tree.map(
        lambda a: activation_spec("repeats", "stages", None, *a.names, rules=in_region),
        axes,
        is_leaf=lambda x: isinstance(x, Axes),
    )


def in_layer_order(values: Array, schedule: Schedule) -> Array:
    """Per-stage values of each chunk's layers for every microbatch ``(P, M, R, k, ...)`` as
    ``(M, L, ...)``, layers in order."""
    order = np.argsort(schedule.virtual_stages, axis=None)  # virtual stage -> chunk
    chunks = einops.rearrange(values, "p m r k ... -> m (r p) k ...")[:, order]
    return einops.rearrange(chunks, "m v k ... -> m (v k) ...")


def varying_over(tree: PyTree, axes: tuple[str, ...]) -> PyTree:
    """Mark every array of ``tree`` as varying over the manual ``axes`` of the pipeline's
    shard_map (``pp``; none outside it).

    Values computed from the stage's own weights already vary;
    constants (a skipped tick's zeros, a fresh carry) do not, and `check_vma` requires both
    branches of a `cond` and both sides of a scan carry to agree. The cast's transpose sums
    the gradient over ``axes``: in float32 where ``x`` is narrower (XLA:CPU cannot compile a
    bfloat16 all-reduce, "Invalid binary instruction opcode copy").
    """

    def cast(x):
        missing = tuple(axis for axis in axes if axis not in varying_axes(x))
        if not missing:
            return x
        if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4:
            return jax.lax.pcast(x.astype(jnp.float32), missing, to="varying").astype(x.dtype)
        return jax.lax.pcast(x, missing, to="varying")

    return jax.tree.map(cast, tree)
