"""The forward-and-backward pipeline executor: runs a 1F1B-family `ActionTable` under the one
`jax.shard_map` (manual over ``pp``, ``cp`` where the sequences are split and ``ep`` where
the experts are: `eqxzoo.parallel.pipeline.pipeline_axes`; on several stages over the
batch's other axes too, `eqxzoo.parallel.pipeline.auto_batch_axes`), computing the loss and
every gradient itself.

Autodiff of a forward pipeline keeps every microbatch's stage inputs until the backward
starts; here the backward of a microbatch runs as soon as its loss exists, so a stage keeps
only the items in flight (the table's ``slots``, at most ``P`` for ``1f1b``/``zb_h1``). Each
tick every stage looks up its action and runs it, each action a `jax.lax.cond` of its own
that takes and returns only the stash buffers it writes (updated in place):

- F: its layers on the item's input (the embedding of the microbatch's tokens on the first
  virtual stage, else the activation that arrived into the item's stash slot); on the last
  virtual stage also the head and loss, whose `jax.vjp` gives the cotangent that starts the
  item's backward and the head's parameter gradients;
- B / BW: `jax.vjp` of the stage (recomputed from the stashed input with ``remat_stages``,
  from the stashed vjp residuals without) applied to the item's cotangent: the input
  cotangent goes one stage back, BW also adds the weight gradient (on the first virtual stage
  the input cotangent flows into the embedding's gradient instead);
- W: the weight gradient only (zero bubble schedules defer it into the drain);
- R (zero bubble schedules with ``remat_stages``): the stage's forward again from the
  stashed input, keeping the residuals the next tick's B reads (one stage's worth, one
  buffer): B and W then each cost about a forward, as F does, and no tick of the lockstep
  waits for a B that recomputes.

A stage sends one thing a tick (an F's activation, a B's cotangent), up the ring and down
it in two `jax.lax.ppermute` after the actions; the table says which arrival a stage
keeps and in which slot it lands (looped placements read activations from below and
cotangents from above; ``zb_v`` reads both from either side, and keeps what its V's turn
on stage ``P - 1`` hands to itself). Weight gradients accumulate stage-locally in the
staged layout (sharded over ``pp`` like the weights); the embedding/head gradients
accumulate on every stage and are summed over stages once at the end, outside the
`shard_map`. MoE aux values are kept per microbatch and layer from its F; their sum over the
layers travels on with the activation, so the last virtual stage has the microbatch's
totals, differentiates the aux loss there, and sends that gradient back with the
cotangent: a loss that pools the aux values of all layers (transformers' load-balance loss)
is then exact in every stage's backward. Nothing of this is differentiated by autodiff:
`pipeline_value_and_grad` returns values and gradients.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jaxtyping import Array, Float, Int, PyTree

from eqxzoo.nn import Axes, Documents, apply_layers, logical_axes
from eqxzoo.nn.stack import RematPolicy, remat, run_layer
from eqxzoo.nn.varying import typed_shape, varying_as, varying_axes, varying_like, zeros_of
from eqxzoo.parallel.backward_split import (
    PullbackResiduals,
    stage_forward,
    stage_input_grad,
    stage_weight_grad,
)
from eqxzoo.parallel.mesh import check_stage_loops
from eqxzoo.parallel.pipeline import (
    RegionAxes,
    batch_split,
    in_layer_order,
    stage_specs,
    transport_dtype,
    varying_over,
)
from eqxzoo.parallel.rules import (
    DEFAULT_RULES,
    MeshAxes,
    activation_spec,
    manual_spec,
    rule_axes,
    tree_shardings,
)
from eqxzoo.parallel.schedule import (
    ACTION_NAMES,
    BW,
    FROM_ABOVE,
    FROM_BELOW,
    RECOMPUTE,
    SOURCES,
    ActionTable,
    B,
    F,
    Schedule,
    W,
)

FirstFn = Callable[
    [PyTree, Int[Array, "batch seq"], Documents | None], Float[Array, "batch seq embed"]
]
LastFn = Callable[
    [PyTree, Float[Array, "batch seq embed"], Int[Array, "batch seq"]], Float[Array, "*parts"]
]


def arrival_sources(table: ActionTable) -> dict[str, list[int]]:
    """The sources (`eqxzoo.parallel.schedule.SOURCES`) something arrives from, per stash
    buffer (``"input"``, ``"grad"``)."""
    return {
        name: [s for s in SOURCES if (column[s] >= 0).any()]
        for name, column in (("input", table.arrive_input), ("grad", table.arrive_grad))
    }


def received_from(arrivals: dict[str, list[int]]) -> list[int]:
    """The sources anything arrives from (`arrival_sources`, over both buffers), sorted."""
    return sorted(set(arrivals["input"]) | set(arrivals["grad"]))


def sends_per_tick(schedule: Schedule) -> int:
    """The collective-permutes over ``pp`` a tick of ``schedule`` (a 1F1B-family one, stage
    remat as it runs) sends: one per distinct `ring_shifts`."""
    sources = received_from(arrival_sources(schedule.actions()))
    return len(set(ring_shifts(schedule.stages, sources).values()))


def ring_shifts(n_stages: int, sources: Sequence[int]) -> dict[int, tuple[tuple[int, int], ...]]:
    """The ``(stage, stage it sends to)`` pairs that carry what arrives from each of
    ``sources`` (`FROM_BELOW`: up the ring; `FROM_ABOVE`: down it; `FROM_SELF` needs none):
    on two stages both ways are one shift (sent once a tick)."""
    up = tuple((stage, (stage + 1) % n_stages) for stage in range(n_stages))
    down = tuple((stage, (stage - 1) % n_stages) for stage in range(n_stages))
    by_source = {FROM_BELOW: up, FROM_ABOVE: down}
    return {source: by_source[source] for source in sources if source in by_source}


def pipeline_value_and_grad(
    layers: PyTree,
    outer: PyTree,
    tokens: Int[Array, "microbatches batch seq"],
    targets: Int[Array, "microbatches batch seq"],
    *,
    documents: Documents | None = None,
    first: FirstFn,
    last: LastFn,
    part_weights: Sequence[float],
    aux_loss: Callable[[dict[str, Array]], Float[Array, ""]],
    schedule: Schedule,
    mesh: Mesh | AbstractMesh,
    remat_policy: RematPolicy = "none",
    remat_stages: bool = True,
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
    bubble_fill: float = 0.0,
) -> tuple[Float[Array, "*parts"], dict[str, Array], PyTree, PyTree]:
    """The loss's parts summed over microbatches (unweighted), every layer's aux values for
    every microbatch ``(microbatches, L, ...)``, and the gradients of the weighted loss with
    respect to ``layers`` and ``outer``.

    ``layers`` are staged (`stage_layers`), ``outer`` is what the pipeline does not stage
    (embedding, head). ``first(outer, tokens, documents)`` gives a microbatch's input to the
    blocks (``documents``: the microbatch's packed documents, which every layer takes too,
    or None),
    ``last(outer, h, targets)`` its share of the loss (the caller divides by the tokens of the
    whole batch, so the shares sum to the loss's parts): a vector of the loss's per-token
    parts (cross-entropy, z-loss), differentiated as their sum weighted by ``part_weights``
    and returned unweighted, summed over microbatches. ``aux_loss(totals)`` is one
    microbatch's share of the loss from its aux values summed over all layers (weighted; its
    value is the caller's to compute from the returned aux values, its gradient enters the
    backward). Gradients are those of the summed loss plus the aux terms; layer gradients
    are staged.
    ``bubble_fill`` is what an idle tick sends to its neighbours (tests send NaN to show that
    nothing an idle tick sends is ever read).
    """
    assert schedule.fuses_backward, schedule
    assert mesh.shape["pp"] == schedule.stages, (mesh.shape, schedule)
    check_stage_loops(layers, mesh)
    schedule = schedule.for_stage_remat(remat_stages)
    table = schedule.actions()
    n_stages, n_repeats = schedule.stages, schedule.repeats
    n_slots = table.slots
    pipelined = n_stages > 1
    region = RegionAxes.of(mesh, layers, rules, pipelined=pipelined)
    manual_axes = region.manual
    manual = bool(manual_axes)
    data_axes = region.data

    virtual_stages = jnp.asarray(schedule.virtual_stages)
    arrivals = arrival_sources(table)
    sources = received_from(arrivals)
    shifts = ring_shifts(n_stages, sources)
    columns = {
        name: jnp.asarray(getattr(table, name))
        for name in ("action", "microbatch", "repeat", "slot")
    }
    arrive = {"input": jnp.asarray(table.arrive_input), "grad": jnp.asarray(table.arrive_grad)}
    # Per-layer data (integer arrays such as sliding windows) is staged with the weights but
    # never differentiated.
    layer_arrays, layer_static = eqx.partition(layers, eqx.is_array)
    layer_params, layer_data = eqx.partition(layer_arrays, eqx.is_inexact_array)
    outer_params, outer_static = eqx.partition(outer, eqx.is_inexact_array)

    # On one stage the layers' inputs are constrained to the batch's split, or with the ids
    # entering replicated (below) every data-parallel device ran the whole batch.
    split_batch = batch_split(mesh, region, rules)

    def stage_fn(stage_params, stage_data, h, documents):
        stage = eqx.combine(stage_params, stage_data, layer_static)
        return apply_layers(stage, split_batch(h), documents=documents, remat_policy=remat_policy)

    def stage_with(stage_data, documents):
        """The stage as a function of its weights and input, for one repeat's data and a
        microbatch's documents."""
        return lambda stage_params, h: stage_fn(stage_params, stage_data, h, documents)

    # A schedule with W actions cuts each layer's backward into B and W
    # (`eqxzoo.parallel.backward_split`): the stage then runs layer by layer.
    scheduled = set(np.unique(np.asarray(table.action)).tolist())
    splits_backward = W in scheduled
    one_layer = remat(
        lambda w, d, h, documents: run_layer(
            eqx.combine(w, d, layer_static), split_batch(h), documents=documents
        ),
        remat_policy,
    )

    def layer_fn_for(documents):
        """A layer as `eqxzoo.parallel.backward_split` takes it, for a microbatch's documents."""
        return lambda w, d, h: one_layer(w, d, h, documents)

    def first_fn(params, tokens_m, documents_m):
        return first(eqx.combine(params, outer_static), tokens_m, documents_m)

    def last_fn(params, h, targets_m):
        return last(eqx.combine(params, outer_static), h, targets_m)

    n_micro = tokens.shape[0]

    def zeros_like(shapes):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def to_float32(tree):
        return jax.tree.map(lambda g: g.astype(jnp.float32), tree)

    def per_stage(
        layer_params, layer_data, outer_params, tick_tokens, tick_targets, tick_documents
    ):
        stage = jax.lax.axis_index("pp") if pipelined else 0
        layer_params, layer_data = jax.tree.map(lambda p: p[:, 0], (layer_params, layer_data))
        # Used by every shard of the batch (cp, ep): their gradients are summed once, at the
        # end, over the axes each weight is whole on (not the experts' own, over ep).
        split_over = jax.tree.map(varying_axes, layer_params)
        layer_params = varying_over(layer_params, manual_axes)
        outer_params = varying_over(outer_params, manual_axes)
        varying = lambda tree: varying_over(tree, manual_axes)  # noqa: E731

        # Traced here, where the layers see the region's axes (a shard of each sequence).
        one_repeat, one_repeat_data = jax.tree.map(lambda p: p[0], (layer_params, layer_data))
        ids = jax.ShapeDtypeStruct(tick_tokens.shape[2:], tick_tokens.dtype)
        # Placeholders for shapes and layouts only: a microbatch's documents.
        probe_documents = None if tick_documents is None else tick_documents[0, 0]
        h_shape = _shape_of(jax.eval_shape(first_fn, outer_params, ids, probe_documents))
        probe = varying(jnp.zeros(h_shape.shape, h_shape.dtype))
        loss_shape = jax.eval_shape(last_fn, outer_params, probe, ids).shape
        _, aux_shapes = jax.eval_shape(
            stage_fn, one_repeat, one_repeat_data, probe, probe_documents
        )
        # A microbatch's aux values summed over layers: what travels with its activation.
        total_shapes = {
            name: jax.ShapeDtypeStruct(shape.shape[1:], shape.dtype)
            for name, shape in aux_shapes.items()
        }
        transport = transport_dtype(h_shape.dtype) if pipelined else h_shape.dtype

        def pooled(totals):
            """A microbatch's aux totals over all its sequences (each device holds its own;
            the layers average their statistics over cp and ep themselves)."""
            return jax.lax.pmean(totals, region.pooled) if region.pooled else totals

        def fit_cotangent(outputs, cotangent):
            """``cotangent`` for ``outputs``: in their dtypes, varying over the manual axes
            where they do (`varying_as`; inside a region, zero for an output that does not
            vary: a constant). Without a region (one stage of a dense model) nothing varies,
            and every cotangent is kept: zeroing them had left every layer's gradient zero."""
            return jax.tree.map(
                lambda output, value: (
                    varying_as(value.astype(output.dtype), output)
                    if varying_axes(output) or not manual
                    else jnp.zeros(output.shape, output.dtype)
                ),
                outputs,
                cotangent,
            )

        weights, data = jax.tree.map(lambda p: p[0], (layer_params, layer_data))
        w_stash_shapes, residual_shapes = [], []
        kept_residuals = InSlots({}, 0)
        if splits_backward:
            first_weights, first_data = jax.tree.map(lambda p: p[0], (weights, data))
            probe_layer_fn = layer_fn_for(probe_documents)

            def first_layer(w, x):
                return probe_layer_fn(w, first_data, x)

            layer_layout = PullbackResiduals.of(first_layer, first_weights, probe)
            # Traced on placeholders for their shapes only (dead code, as the layouts are).
            _, probe_residuals = stage_forward(probe_layer_fn, layer_layout, weights, data, probe)
            _, probe_stash = stage_input_grad(
                probe_layer_fn,
                layer_layout,
                weights,
                data,
                probe_residuals,
                probe,
                varying(zeros_like(total_shapes)),
                fit_cotangent,
            )
            w_stash_shapes = [typed_shape(leaf) for leaf in probe_stash]
            from_inputs = layer_layout.from_inputs(first_layer, first_weights, probe)
            kept_residuals = InSlots.of(probe_residuals, from_inputs)
            residual_shapes = [
                typed_shape(leaf) for leaf in kept_residuals.in_slots(probe_residuals)
            ]
        elif not remat_stages:
            layout = PullbackResiduals.of(stage_with(data, probe_documents), weights, probe)
            residual_shapes = list(layout.shapes)

        def embedding_grads(tokens_m, documents_m, d_h):
            """The outer parameters' gradient through ``first`` of a microbatch's tokens."""
            _, pullback = jax.vjp(lambda o: first_fn(o, tokens_m, documents_m), outer_params)
            return pullback(d_h)[0]

        def vjp_of_stage(weights, data, documents_m, h_in, h_grad, aux_grad, residuals):
            """The stage's pullback, and the cotangent of its outputs: the item's gradient,
            and for every layer's aux values the aux loss's gradient at the microbatch's
            totals (zero for an output that does not vary over ``pp``: a constant)."""
            stage = stage_with(data, documents_m)
            if remat_stages:
                outputs, pullback = jax.vjp(stage, weights, h_in)
            else:
                outputs = jax.eval_shape(stage, weights, h_in)
                pullback = layout.pullback(weights, residuals)
            per_layer = {
                name: jnp.broadcast_to(aux_grad[name], shape.shape)
                for name, shape in aux_shapes.items()
            }
            return pullback, fit_cotangent(outputs, (h_grad, per_layer))

        def tick(carry: TickCarry, tick_inputs) -> tuple[TickCarry, None]:
            """One tick of every stage: the action the table names, then the exchange with
            the neighbouring stages."""
            t, tokens_m, targets_m, documents_m = tick_inputs
            layer_fn = layer_fn_for(documents_m)
            row = {name: column[t, stage] for name, column in columns.items()}
            kind, r, slot, m = row["action"], row["repeat"], row["slot"], row["microbatch"]
            # What was sent at the tick before (by the stage below, the stage above or this
            # one) lands in the slot the table names: activations with the aux totals so
            # far, cotangents with the aux loss's gradient.
            buffers = {
                "input": (carry.stash.inputs, carry.stash.input_totals),
                "grad": (carry.stash.grads, carry.stash.aux_grads),
            }
            for name, sides in arrivals.items():
                for source in sides:
                    at = arrive[name][source, t, stage]
                    value, tree = carry.received[source]
                    buffer, trees = buffers[name]
                    buffers[name] = (
                        _write(buffer, at, value.astype(h_shape.dtype)),
                        jax.tree.map(lambda b, v, at=at: _write(b, at, v), trees, tree),
                    )
            (inputs, input_totals), (grads, aux_grads) = buffers["input"], buffers["grad"]
            stash = carry.stash._replace(
                inputs=inputs, grads=grads, input_totals=input_totals, aux_grads=aux_grads
            )
            weights, data = jax.tree.map(lambda p: p[r], (layer_params, layer_data))
            is_first = virtual_stages[r, stage] == 0
            is_last = virtual_stages[r, stage] == n_stages * n_repeats - 1
            # Without stage remat each item's F stashes its residuals in its slot; with it,
            # R keeps them in the one buffer for the B at the next tick.
            residual_slot = 0 if schedule.recompute else slot

            def add_outer_grads(outer_grads, when, grads_fn):
                """``outer_grads`` plus ``grads_fn()`` where ``when`` (the embedding's on the
                first virtual stage, the head's on the last); elsewhere no outer-sized work."""
                return jax.lax.cond(
                    when,
                    lambda acc: jax.tree.map(
                        lambda a, g: a + g.astype(a.dtype), acc, varying(grads_fn())
                    ),
                    lambda acc: acc,
                    outer_grads,
                )

            def add_layer_grads(layer_grads, d_weights):
                return jax.tree.map(
                    lambda acc, d: acc.at[r].add(d.astype(acc.dtype)), layer_grads, d_weights
                )

            def forward(written: dict, sent: Sent) -> tuple[dict, Sent]:
                h_in = jax.lax.cond(
                    is_first,
                    lambda: varying(first_fn(outer_params, tokens_m, documents_m)),
                    lambda: stash.inputs[slot],
                )
                if remat_stages:
                    h_out, aux = stage_fn(weights, data, h_in, documents_m)
                else:
                    if splits_backward:
                        (h_out, aux), new_residuals = stage_forward(
                            layer_fn, layer_layout, weights, data, h_in
                        )
                        new_residuals = kept_residuals.in_slots(new_residuals)
                    else:
                        (h_out, aux), pullback = jax.vjp(
                            stage_with(data, documents_m), weights, h_in
                        )
                        new_residuals = layout.residuals(pullback)
                    written["residuals"] = [
                        buffer.at[slot].set(value)
                        for buffer, value in zip(written["residuals"], new_residuals, strict=True)
                    ]
                totals = jax.tree.map(
                    lambda arrived, values: jnp.where(is_first, 0, arrived) + values.sum(axis=0),
                    jax.tree.map(lambda buffer: buffer[slot], stash.input_totals),
                    aux,
                )

                def head(sums):
                    """The last virtual stage's loss: its parts, the outer parameters'
                    gradient, and the item's cotangent with the aux loss's gradient."""
                    grads, aux_grads, outer_grads, loss_sum = sums
                    loss, pullback = jax.vjp(
                        lambda o, h: last_fn(o, h, targets_m), outer_params, h_out
                    )
                    d_outer, d_h = pullback(
                        jnp.ones_like(loss) * jnp.asarray(part_weights, loss.dtype)
                    )
                    aux_grad = jax.grad(lambda t: aux_loss(pooled(t)))(totals)
                    return varying(
                        (
                            grads.at[slot].set(d_h.astype(h_shape.dtype)),
                            jax.tree.map(lambda b, v: b.at[slot].set(v), aux_grads, aux_grad),
                            jax.tree.map(lambda a, g: a + g.astype(a.dtype), outer_grads, d_outer),
                            loss_sum + loss.astype(jnp.float32),
                        )
                    )

                names = ("grads", "aux_grads", "outer_grads", "loss")
                with jax.named_scope(HEAD_SCOPE):
                    sums = jax.lax.cond(
                        is_last, head, lambda sums: sums, tuple(written[name] for name in names)
                    )
                written |= dict(zip(names, sums, strict=True))
                written["aux"] = jax.tree.map(
                    lambda acc, v: acc.at[m, r].add(v), written["aux"], aux
                )
                return written, (h_out.astype(h_shape.dtype), totals, h_in)

            def backward(weight_grad: bool, input_grad: bool):
                def run(written: dict, sent: Sent) -> tuple[dict, Sent]:
                    aux_grad = jax.tree.map(lambda buffer: buffer[slot], stash.aux_grads)
                    residuals = [buffer[residual_slot] for buffer in stash.residuals]
                    pullback, cotangent = vjp_of_stage(
                        weights,
                        data,
                        documents_m,
                        stash.inputs[slot],
                        stash.grads[slot],
                        aux_grad,
                        residuals,
                    )
                    d_weights, d_h = pullback(cotangent)
                    if weight_grad:
                        written["layer_grads"] = add_layer_grads(
                            written["layer_grads"], to_float32(d_weights)
                        )
                    if input_grad:
                        written["outer_grads"] = add_outer_grads(
                            written["outer_grads"],
                            is_first,
                            lambda: embedding_grads(tokens_m, documents_m, d_h),
                        )
                        sent = (d_h.astype(h_shape.dtype), aux_grad, sent[2])
                    return written, sent

                return run

            def split_backward(weight_grad: bool, input_grad: bool):
                """B, W or both with the backward cut layer by layer: B keeps W's stash in
                the item's slot, W reads it from there."""

                def run(written: dict, sent: Sent) -> tuple[dict, Sent]:
                    aux_grad = jax.tree.map(lambda buffer: buffer[slot], stash.aux_grads)
                    if input_grad:
                        d_h, w_stash = stage_input_grad(
                            layer_fn,
                            layer_layout,
                            weights,
                            data,
                            kept_residuals.whole(
                                [buffer[residual_slot] for buffer in stash.residuals]
                            ),
                            stash.grads[slot],
                            aux_grad,
                            fit_cotangent,
                        )
                        if not weight_grad:
                            written["w_stash"] = [
                                buffer.at[slot].set(value)
                                for buffer, value in zip(written["w_stash"], w_stash, strict=True)
                            ]
                        written["outer_grads"] = add_outer_grads(
                            written["outer_grads"],
                            is_first,
                            lambda: embedding_grads(tokens_m, documents_m, d_h),
                        )
                        sent = (d_h.astype(h_shape.dtype), aux_grad, sent[2])
                    else:
                        w_stash = [buffer[slot] for buffer in stash.w_stash]
                    if weight_grad:
                        d_weights = stage_weight_grad(
                            layer_fn,
                            weights,
                            data,
                            w_stash,
                            stash.grads[slot],
                            aux_grad,
                            fit_cotangent,
                        )
                        written["layer_grads"] = add_layer_grads(
                            written["layer_grads"], to_float32(d_weights)
                        )
                    return written, sent

                return run

            def recompute(written: dict, sent: Sent) -> tuple[dict, Sent]:
                _, new_residuals = stage_forward(
                    layer_fn, layer_layout, weights, data, stash.inputs[slot]
                )
                written["residuals"] = [
                    buffer.at[0].set(value)
                    for buffer, value in zip(
                        written["residuals"], kept_residuals.in_slots(new_residuals), strict=True
                    )
                ]
                return written, sent

            chosen = split_backward if splits_backward else backward
            # Each action, with the stash buffers it writes (and reads none of, or XLA copies
            # them whole).
            actions = {
                F: (
                    forward,
                    ("grads", "aux_grads", "outer_grads", "loss", "aux")
                    + (() if remat_stages else ("residuals",)),
                ),
                B: (chosen(weight_grad=False, input_grad=True), ("w_stash", "outer_grads")),
                W: (chosen(weight_grad=True, input_grad=False), ("layer_grads",)),
                BW: (chosen(weight_grad=True, input_grad=True), ("layer_grads", "outer_grads")),
                RECOMPUTE: (recompute, ("residuals",)),
            }
            # An idle tick (and one that sends nothing) sends the fill.
            sent = varying(
                (
                    jnp.full(h_shape.shape, bubble_fill, h_shape.dtype),
                    jax.tree.map(lambda s: jnp.full(s.shape, bubble_fill, s.dtype), total_shapes),
                    jnp.zeros(h_shape.shape, h_shape.dtype),
                )
            )
            # Each action the table names runs in a conditional of its own that takes and
            # returns only the buffers it writes: XLA updates them in place, and a tick that
            # runs another action pays nothing for them (one switch over all the actions
            # would have every branch fill every action's outputs). An action the table
            # never names (1F1B's B and W, ZB-H1's BW) is not compiled.
            for action, (run, writes) in actions.items():
                if action not in scheduled:
                    continue

                def active(operands, run=run):
                    # Each output as varying as its operand (what the idle branch returns).
                    written, sent = operands
                    return jax.tree.map(varying_like, run(dict(written), sent), operands)

                written = {name: getattr(stash, name) for name in writes}
                with jax.named_scope(action_scope(action)):
                    written, sent = jax.lax.cond(
                        kind == action, active, lambda operands: operands, (written, sent)
                    )
                stash = stash._replace(**written)
            send, send_totals, first_input = sent
            # The first virtual stage's F made its input (the embedding) itself.
            first_slot = jnp.where((kind == F) & is_first, slot, -1)
            stash = stash._replace(inputs=_write(stash.inputs, first_slot, first_input))
            # A stage sends one thing a tick (an F's activation, a B's cotangent) to the
            # stage below or above (or keeps it, on a V's turn): around the ring both ways
            # (one way on two stages), in `transport_dtype`.
            message = (send.astype(transport), send_totals)
            sent_by_shift = {
                pairs: jax.lax.ppermute(message, "pp", pairs) if pipelined else message
                for pairs in dict.fromkeys(shifts.values())
            }
            received = {
                source: sent_by_shift[shifts[source]] if source in shifts else message
                for source in sources
            }
            return TickCarry(received=received, stash=stash), None

        slot_buffer = jnp.zeros((n_slots, *h_shape.shape), h_shape.dtype)
        total_slots = jax.tree.map(lambda s: jnp.zeros((n_slots, *s.shape), s.dtype), total_shapes)
        init = varying(
            TickCarry(
                received={
                    source: (jnp.zeros(h_shape.shape, transport), zeros_like(total_shapes))
                    for source in sources
                },
                stash=Stash(
                    inputs=slot_buffer,
                    grads=slot_buffer,
                    input_totals=total_slots,
                    aux_grads=total_slots,
                    residuals=[],
                    w_stash=[],
                    layer_grads=to_float32(jax.tree.map(jnp.zeros_like, layer_params)),
                    outer_grads=to_float32(jax.tree.map(jnp.zeros_like, outer_params)),
                    loss=jnp.zeros(loss_shape, jnp.float32),
                    aux=jax.tree.map(
                        lambda s: jnp.zeros((n_micro, n_repeats, *s.shape), s.dtype), aux_shapes
                    ),
                ),
            )
        )
        # The pullback's residuals and W's stash vary over what their values do, and the
        # stages (their slots do), no more: a router statistic averaged over cp does not
        # vary over it, and the pullback must read it back so.
        slot_axes = ("pp",) if pipelined else ()
        init = init._replace(
            stash=init.stash._replace(
                residuals=[
                    zeros_of(s, (1 if remat_stages else n_slots,), slot_axes)
                    for s in residual_shapes
                ],
                w_stash=[zeros_of(s, (n_slots,), slot_axes) for s in w_stash_shapes],
            )
        )
        ticks = (
            jnp.arange(table.ticks),
            tick_tokens[:, 0],
            tick_targets[:, 0],
            None if tick_documents is None else tick_documents[:, 0],
        )
        final, _ = jax.lax.scan(tick, init, ticks)
        sums = final.stash
        layer_grads, outer_grads, loss, aux = (
            sums.layer_grads,
            sums.outer_grads,
            sums.loss,
            sums.aux,
        )
        if data_axes:
            # Each shard of the batch holds its tokens' part of the loss and gradients; the
            # aux values are already the whole batch's (the layers average them).
            def summed(grad, split):
                axes = tuple(a for a in data_axes if a not in split)
                return jax.lax.psum(grad, axes) if axes else grad

            layer_grads = jax.tree.map(summed, layer_grads, split_over)
            outer_grads, loss = jax.lax.psum((outer_grads, loss), data_axes)
            aux = jax.lax.pmean(aux, data_axes)
        layer_grads = jax.tree.map(lambda g: g[:, None], layer_grads)
        stacked = jax.tree.map(lambda v: v[None], (outer_grads, loss, aux))
        return layer_grads, *stacked

    def spec(*names):
        return manual_spec(*names, manual_axes=manual_axes, rules=rules)

    stage_spec = eqx.partition(
        stage_specs(layer_arrays, layer_static, region.layers, rules),
        jax.tree.map(eqx.is_inexact_array, layer_arrays),
    )
    per_stage_spec = spec("stages")
    replicated = spec()
    per_tick_spec = spec(None, "stages", "batch", "seq")
    if manual:
        # The embedding and head run inside the shard_map, where pp is manual: their
        # parameters enter sharded by the rules without pp (XLA's partitioner fails on an
        # auto sharding over pp entering a region manual over pp, next to dp and tp).
        without_pp = {name: tuple(a for a in rule_axes(name, rules) if a != "pp") for name in rules}
        is_param = jax.tree.map(eqx.is_inexact_array, outer)
        outer_axes, _ = eqx.partition(
            logical_axes(outer), is_param, is_leaf=lambda x: isinstance(x, Axes)
        )
        outer_params = jax.lax.with_sharding_constraint(
            outer_params, tree_shardings(outer_params, outer_axes, mesh, without_pp)
        )
        run = jax.shard_map(
            per_stage,
            mesh=mesh,
            in_specs=(*stage_spec, replicated, per_tick_spec, per_tick_spec, per_tick_spec),
            out_specs=(stage_spec[0], per_stage_spec, per_stage_spec, per_stage_spec),
            axis_names=set(manual_axes),
            check_vma=True,
        )
    else:
        run = per_stage
    # Each stage's tokens and targets tick by tick, (ticks, stages, batch, seq), sliced by
    # the scan. They are whole over the axes the compiler splits (XLA's partitioner fails on
    # the embedding's and the loss's gathers of batch-split ids inside a region manual over
    # pp, next to tp; int32 ids are a sliver of the activations); the region splits them
    # over its own.
    replicated_ids = NamedSharding(mesh, activation_spec(rules=rules))
    tick_tokens = jax.lax.with_sharding_constraint(tokens[columns["microbatch"]], replicated_ids)
    tick_targets = jax.lax.with_sharding_constraint(targets[columns["microbatch"]], replicated_ids)
    tick_documents = (
        None
        if documents is None
        else jax.lax.with_sharding_constraint(documents[columns["microbatch"]], replicated_ids)
    )
    layer_grads, outer_grads, loss_sums, aux_sums = run(
        layer_params, layer_data, outer_params, tick_tokens, tick_targets, tick_documents
    )
    outer_grads = jax.tree.map(lambda g: g.sum(axis=0), outer_grads)
    layer_aux = jax.tree.map(lambda v: in_layer_order(v, schedule), aux_sums)
    return loss_sums.sum(axis=0), layer_aux, layer_grads, outer_grads


class InSlots(NamedTuple):
    """Which of the split backward's pullback residuals an item keeps in its stash slots.
    Those made from constants alone (`computed_from_inputs`; a context shard's positions)
    are the same at every tick: the layout trace's values (``fixed``, by their place among
    ``count``) stand for them. Read back at a slot, whose index varies over pp, they would
    vary over pp too, unlike the equations of B that read them, which were traced without."""

    fixed: dict[int, Array]
    count: int

    @classmethod
    def of(cls, traced: Sequence[Array], from_inputs: Sequence[bool]) -> "InSlots":
        fixed = {
            i: leaf
            for i, (leaf, computed) in enumerate(zip(traced, from_inputs, strict=True))
            if not computed
        }
        return cls(fixed, len(traced))

    def in_slots(self, values: Sequence) -> list:
        """What of ``values`` (one for each residual) the slots keep."""
        return [value for i, value in enumerate(values) if i not in self.fixed]

    def whole(self, in_slots: Sequence[Array]) -> list[Array]:
        """Every residual: what the slots kept, and the fixed ones."""
        kept = iter(in_slots)
        return [self.fixed[i] if i in self.fixed else next(kept) for i in range(self.count)]


class Stash(NamedTuple):
    """What a stage keeps from tick to tick besides what was just sent to it: per item in
    flight (one slot each) its stage input with the aux totals so far (``inputs``,
    ``input_totals``), its output cotangent with the aux loss's gradient (``grads``,
    ``aux_grads``), its pullback's residuals (``residuals``: per slot without stage remat,
    R's one buffer with it) and B's stash for W (``w_stash``); and its sums: ``layer_grads``
    per repeat, ``outer_grads``, ``loss``, ``aux`` per microbatch and repeat."""

    inputs: Array
    grads: Array
    input_totals: dict[str, Array]
    aux_grads: dict[str, Array]
    residuals: list[Array]
    w_stash: list[Array]
    layer_grads: PyTree
    outer_grads: PyTree
    loss: Array
    aux: dict[str, Array]


class TickCarry(NamedTuple):
    """What a stage carries from tick to tick: what was sent to it at the tick before,
    ``received[source]`` (the value and its aux tree, from each source some arrival of the
    table reads: `eqxzoo.parallel.schedule.SOURCES`), and its `Stash`."""

    received: dict[int, tuple[Array, dict[str, Array]]]
    stash: Stash


# What a tick's action sends (value and aux tree), and the input an F on the first virtual
# stage made (its embedding).
Sent = tuple[Array, dict[str, Array], Array]


# The name scope of the conditional in which the last virtual stage's F adds the head, the
# loss and their backward (its true branch runs in one F of every ``P R``).
HEAD_SCOPE = "pipeline_head"


def action_scope(kind: int) -> str:
    """The name scope of the conditional that runs action ``kind`` in a tick (its true
    branch is the action's program: `eqxzoo.parallel.action_costs` prices it)."""
    return f"pipeline_action_{ACTION_NAMES[kind]}"


def _shape_of(value: Array | jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(value.shape, value.dtype)


def _write(buffer: Array, slot: Array, value: Array) -> Array:
    """``buffer`` with ``value`` at ``slot`` (unchanged for a negative slot)."""
    index = jnp.maximum(slot, 0)
    return buffer.at[index].set(jnp.where(slot >= 0, value, buffer[index]))
