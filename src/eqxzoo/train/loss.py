"""The training loss: the weighted sum of `eqxzoo.train.loss_terms.LOSS_TERMS` (token-mean
cross-entropy, an optional z-loss on the logits, the MoE auxiliary losses), computed through the pipeline (`pipelined_loss`,
differentiated by autodiff), with its gradients by the 1F1B-family executor
(`pipelined_loss_and_grad`), or the plain way as a reference (`sequential_loss`).

Targets below zero (`IGNORED`) are not targets: a loss mask (prompts, padding) is written
into the targets, as PyTorch's and Hugging Face's ``ignore_index`` is. Each per-token term is
summed over the target tokens and divided by a ``normalizer``: by default their count, a
masked mean; the train step passes its share of the whole global batch's count
(`eqxzoo.train.step.accumulated_gradients`), so that the loss is the sum over every target
token of the batch divided by their number, never a mean of per-microbatch means.

The trainer's cross-entropy is the fused, chunked one (`eqxzoo.nn.fused_cross_entropy`,
``[loss] chunk_size`` > 0): the head's matmul, log-softmax and loss run over vocabulary
chunks, so the ``(tokens, vocab)`` logits never exist. ``chunk_size = 0`` computes the
plain logits instead (the reference `sequential_loss` always does).

Batches of packed documents carry `eqxzoo.nn.Documents` (``segments`` and ``positions`` of
every token, `batch_documents`): every loss takes them as ``documents`` and hands them to
the embedding (learned positions) and to every layer of the prefix and the pipeline.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PyTree

from eqxzoo.nn import (
    Axes,
    ContextSplit,
    Documents,
    LanguageModel,
    Stack,
    balanced_order,
    fused_cross_entropy,
    layer_means,
    summarize_layer_aux,
)
from eqxzoo.parallel import activation_sharding, pipeline_value_and_grad, run_pipeline
from eqxzoo.parallel.mesh import DP_ACROSS_SLICES
from eqxzoo.parallel.pipeline import CONTEXT_AXIS, RegionAxes, batch_axes, varying_over
from eqxzoo.parallel.rules import MeshAxes, manual_spec, partition_spec, rule_axes
from eqxzoo.train.loss_terms import aux_terms, token_terms, weighted_aux_loss, weighted_loss
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import cast_floats

IGNORED = -1  # a target id that is not a target: its token adds nothing to the loss
DOCUMENT_FIELDS = ("segments", "positions")  # a batch's `Documents`, when it has them


def batch_documents(batch: Mapping[str, Array]) -> Documents | None:
    """The packed documents of a batch (its ``segments`` and ``positions``, shaped like its
    ``tokens``), or None for a batch without them."""
    if not all(name in batch for name in DOCUMENT_FIELDS):
        assert not any(name in batch for name in DOCUMENT_FIELDS), sorted(batch)
        return None
    return Documents(segments=batch["segments"], positions=batch["positions"])


def target_mask(targets: Int[Array, "*tokens"]) -> Float[Array, "*tokens"]:
    """1.0 where ``targets`` holds a target, 0.0 where it is `IGNORED` (any id below zero)."""
    return (targets >= 0).astype(jnp.float32)


def target_count(targets: Int[Array, "*tokens"]) -> Float[Array, ""]:
    """The number of target tokens in ``targets`` (float32)."""
    return jnp.sum(target_mask(targets))


def default_normalizer(
    targets: Int[Array, "*tokens"], normalizer: Float[Array, ""] | None
) -> Float[Array, ""]:
    """``normalizer``, or the target tokens of ``targets`` (at least 1: a batch with none
    has a loss of 0)."""
    return jnp.maximum(target_count(targets), 1.0) if normalizer is None else normalizer


def pipelined_loss(
    model: LanguageModel,
    tokens: Int[Array, "microbatches batch seq"],
    targets: Int[Array, "microbatches batch seq"],
    *,
    config: StepConfig,
    mesh: Mesh | AbstractMesh,
    normalizer: Float[Array, ""] | None = None,
    documents: Documents | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Cross-entropy over the target tokens (summed, divided by ``normalizer``: module
    docstring) plus weighted aux losses, with the blocks pipelined over ``pp``.

    ``model`` is in the pipeline layout. Embedding, prefix and head run outside the pipeline;
    the prefix's layers split the microbatches over ``pp`` (rule ``prefix_microbatches``)
    where they divide, instead of every stage computing them all. Where the mesh splits the
    sequences over ``cp``, the tokens are laid out for balance first (`in_context_order`).
    """
    model = cast_floats(model, config.precision.compute)
    n_micro = tokens.shape[0]
    normalizer = default_normalizer(targets, normalizer)
    tokens, targets, documents, positions = in_context_order(tokens, targets, documents, mesh)
    with jax.named_scope("embed"):
        h = model.embed(tokens, positions)
    if model.prefix is not None:
        with jax.named_scope("prefix"):
            if n_micro % mesh.shape["pp"] == 0:
                h = jax.lax.with_sharding_constraint(
                    h,
                    activation_sharding(
                        mesh, "prefix_microbatches", "batch", "seq", rules=config.rules
                    ),
                )
            h = run_prefix(model.prefix, h, mesh, config.rules, documents)
    with jax.named_scope("pipeline"):
        h, layer_aux = run_pipeline(
            model.blocks.layers,
            h,
            documents=documents,
            schedule=config.schedule,
            mesh=mesh,
            remat_policy=model.blocks.remat_policy,
            remat_stages=config.remat_stages,
            rules=config.rules,
            bubble_fill=config.bubble_fill,
            skip_bubbles=config.skip_bubbles,
        )
    with jax.named_scope("head"):
        h = jax.lax.with_sharding_constraint(
            h, activation_sharding(mesh, "microbatches", "batch", "seq", rules=config.rules)
        )
        token_losses, log_normalizers = token_cross_entropy(model, h, targets, config, mesh)
    aux = batch_aux_metrics(summarize_microbatches(over_slices(layer_aux, mesh, config)), config)
    return total_loss(token_losses, log_normalizers, target_mask(targets), normalizer, aux, config)


def splits_context(mesh: Mesh | AbstractMesh) -> bool:
    """Whether ``mesh`` splits each sequence's tokens over ``cp`` (context parallelism)."""
    return mesh.shape.get(CONTEXT_AXIS, 1) > 1


def in_context_order(
    tokens: Int[Array, "*batch seq"],
    targets: Int[Array, "*batch seq"],
    documents: Documents | None,
    mesh: Mesh | AbstractMesh,
) -> tuple[
    Int[Array, "*batch seq"],
    Int[Array, "*batch seq"],
    Documents | None,
    Int[Array, "*#batch seq"] | None,
]:
    """``tokens``, ``targets`` and ``documents`` in the order whose ``cp`` shards carry equal
    causal work (`eqxzoo.nn.balanced_order`), and the positions the embedding takes: the
    documents', else where the tokens then sit (None, the plain order, without ``cp``). The
    loss is a sum over tokens, so the order changes nothing."""
    if splits_context(mesh):
        order = balanced_order(tokens.shape[-1], mesh.shape[CONTEXT_AXIS])
        tokens, targets = tokens[..., order], targets[..., order]
        documents = None if documents is None else documents[..., order]
        positions = jnp.asarray(order, jnp.int32)
    else:
        positions = None
    return tokens, targets, documents, positions if documents is None else documents.positions


def run_prefix(
    prefix: Stack,
    h: Float[Array, "microbatches batch seq embed"],
    mesh: Mesh | AbstractMesh,
    rules: Mapping[str, MeshAxes],
    documents: Documents | None = None,
) -> Float[Array, "microbatches batch seq embed"]:
    """The model's prefix layers on ``h`` (their aux values dropped, as the loss has no use
    for them), inside a region manual over the axes that split the batch, each device
    running its own sequences with the layers' weights whole (gathered once, their gradients
    summed once), and over ``cp`` where the sequences are split, where their attention
    exchanges the shards' keys and values. Left to the compiler, a batch split over dp and
    ep together was gathered in the backward: every device ran the prefix on all of it."""
    manual_axes = batch_axes(mesh, rules) + ((CONTEXT_AXIS,) if splits_context(mesh) else ())
    if not manual_axes:
        return prefix(h, documents=documents)[0]
    arrays, static = eqx.partition(prefix, eqx.is_array)

    def run(arrays, h, documents):
        # Used by every shard: their gradient is summed over the manual axes once, here.
        weights, data = eqx.partition(arrays, eqx.is_inexact_array)
        weights = varying_over(weights, manual_axes)
        return eqx.combine(weights, data, static)(h, documents=documents)[0]

    spec = manual_spec("microbatches", "batch", "seq", manual_axes=manual_axes, rules=rules)
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(manual_spec(manual_axes=manual_axes, rules=rules), spec, spec),
        out_specs=spec,
        axis_names=set(manual_axes),
        check_vma=True,
    )(arrays, h, documents)


def over_slices(
    layer_aux: dict[str, Array], mesh: Mesh | AbstractMesh, config: StepConfig
) -> dict[str, Array]:
    """``layer_aux`` (each a mean over this slice's sequences) averaged over the slices that
    run the step on their own (`eqxzoo.train.step.per_slice`: the mesh's axes across slices
    that ``config`` leaves out), before the aux loss terms combine them: router statistics
    of the whole microbatch, as on one device."""
    slices = tuple(
        axis
        for axis in mesh.axis_names
        if axis == DP_ACROSS_SLICES and axis not in config.mesh_axes
    )
    return jax.lax.pmean(layer_aux, slices) if slices else layer_aux


def sequential_loss(
    model: LanguageModel,
    tokens: Int[Array, "microbatches batch seq"],
    targets: Int[Array, "microbatches batch seq"],
    *,
    config: StepConfig,
    normalizer: Float[Array, ""] | None = None,
    documents: Documents | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The same loss computed the plain way: the (unstaged) model vmapped over every sequence."""
    model = cast_floats(model, config.precision.compute)

    if documents is None:
        logits, aux = jax.vmap(jax.vmap(model))(tokens)
    else:
        logits, aux = jax.vmap(jax.vmap(lambda t, d: model(t, documents=d)))(tokens, documents)
    aux = batch_aux_metrics(jax.tree.map(lambda v: jnp.mean(v, axis=1), aux), config)
    token_losses, log_normalizers = plain_cross_entropy(
        logits.astype(config.precision.output), targets
    )
    weights, normalizer = target_mask(targets), default_normalizer(targets, normalizer)
    return total_loss(token_losses, log_normalizers, weights, normalizer, aux, config)


def batch_aux_metrics(aux: dict[str, Array], config: StepConfig) -> dict[str, Array]:
    """The batch's metrics of the model's aux values from each microbatch's (``aux`` in the
    model's format with a leading ``microbatches`` axis): every value's mean over the
    microbatches, and each aux loss term (`eqxzoo.train.loss_terms.aux_terms`) computed per
    microbatch, then averaged."""
    if not aux:
        return {}
    terms = jax.vmap(lambda one: aux_terms(layer_means(one), config.loss))(aux)
    return jax.tree.map(lambda v: jnp.mean(v, axis=0), {**aux, **terms})


def summarize_microbatches(layer_aux: dict[str, Array]) -> dict[str, Array]:
    """`summarize_layer_aux` of each microbatch's per-layer aux values ``(microbatches, L, ...)``."""
    return jax.vmap(summarize_layer_aux)(layer_aux) if layer_aux else {}


def token_cross_entropy(
    model: LanguageModel,
    h: Float[Array, "*batch seq embed"],
    targets: Int[Array, "*batch seq"],
    config: StepConfig,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    manual_pp: bool = False,
) -> tuple[Float[Array, "*batch seq"], Float[Array, "*batch seq"]]:
    """Each token's cross-entropy and its logits' log-sum-exp (for the z-loss), from the
    blocks' output ``h``: fused over vocabulary chunks of ``config.loss.chunk_size`` from
    the model's `head_inputs`, or from the plain logits when it is 0. ``mesh`` (with
    ``manual_pp`` inside a region manual over ``pp``) tells how the vocabulary is sharded
    (`vocab_shards`) and, outside the region, how the tokens are (the batch's axes: the
    loss's ``token_shards``) and how the columns are gathered (`gathered_columns`)."""
    targets = jnp.maximum(targets, 0)  # ignored targets' values are masked out by the caller
    if not config.loss.chunk_size:
        return plain_cross_entropy(model.head(h).astype(config.precision.output), targets)
    features, projection, vocab_major, softcap = model.head_inputs(h)
    n_vocab = projection.shape[0 if vocab_major else 1]
    n_shards = 1 if mesh is None else vocab_shards(n_vocab, mesh, config.rules, manual_pp)
    order, gather = TokenOrder(), None
    if mesh is not None and not manual_pp:
        order = TokenOrder.on(mesh, config.rules, targets.shape)
        gather = gathered_columns(n_shards, mesh, config.rules)
    parts = fused_cross_entropy(
        order.flat(features, 1),
        projection,
        order.flat(targets, 0),
        vocab_major=vocab_major,
        softcap=softcap,
        chunk_size=config.loss.chunk_size,
        vocab_shards=n_shards,
        token_shards=order.shards,
        gather_columns=gather,
    )
    return tuple(order.unflat(part, targets.shape) for part in parts)


@dataclasses.dataclass(frozen=True)
class TokenOrder:
    """The order the fused loss takes ``(*microbatches, batch, seq)`` tokens in, flat: each
    device's own tokens one contiguous block, the flat axis split over ``axes`` (the
    batch's, then cp) as the tokens were. The batch first, then the sequence's ``context``
    blocks, then the rest. Batch-major alone put the microbatches between the batch and
    the sequence, a split the flat axis cannot keep: the partitioner gathered a context
    split's tokens, and every device computed the logits of all of them (4x the loss's
    FLOPs on cp4). ``mesh`` None: left to the partitioner."""

    context: int = 1
    axes: tuple[str, ...] = ()
    mesh: Mesh | AbstractMesh | None = None

    @property
    def shards(self) -> int:
        """How many devices hold a block of the tokens each (the fused loss's
        ``token_shards``)."""
        return 1 if self.mesh is None else math.prod(self.mesh.shape[axis] for axis in self.axes)

    @classmethod
    def on(
        cls, mesh: Mesh | AbstractMesh, rules: Mapping[str, MeshAxes], shape: tuple[int, ...]
    ) -> "TokenOrder":
        """The order for tokens of ``shape`` split as ``rules`` split a batch on ``mesh``."""
        axes = batch_axes(mesh, rules)
        context = mesh.shape.get(CONTEXT_AXIS, 1)
        if len(shape) < 2 or shape[-1] % context:
            context = 1
        if context > 1:
            axes = (*axes, CONTEXT_AXIS)
        return cls(context, axes, mesh)

    def flat(self, x: Array, trailing: int) -> Array:
        """``x`` (``(*lead, batch, seq, *trailing)``, or ``(seq, *trailing)``) with its
        tokens flattened in this order: ``(tokens, *trailing)``."""
        if x.ndim - trailing < 2:
            return x
        seq_axis = x.ndim - trailing - 1
        split = x.reshape(*x.shape[:seq_axis], self.context, -1, *x.shape[seq_axis + 1 :])
        ordered = jnp.moveaxis(split, (seq_axis - 1, seq_axis), (0, 1))
        flat = ordered.reshape(-1, *x.shape[seq_axis + 1 :])
        if self.mesh is None or self.context == 1:
            return flat
        spec = PartitionSpec(self.axes, *(None,) * trailing)
        return jax.lax.with_sharding_constraint(flat, NamedSharding(self.mesh, spec))

    def unflat(self, flat: Array, shape: tuple[int, ...]) -> Array:
        """Per-token values ``flat`` (``(tokens,)``, in this order) back in ``shape``
        (``(*lead, batch, seq)``)."""
        if len(shape) < 2:
            return flat.reshape(shape)
        seq_axis = len(shape) - 1
        ordered = (shape[-2], self.context, *shape[:-2], shape[-1] // self.context)
        split = jnp.moveaxis(flat.reshape(ordered), (0, 1), (seq_axis - 1, seq_axis))
        return split.reshape(shape)


def gathered_columns(
    n_shards: int, mesh: Mesh | AbstractMesh, rules: Mapping[str, MeshAxes]
) -> Callable[[Array], Array]:
    """What the fused loss applies to each vocabulary chunk's ``(embed, shards, width)``
    columns outside the pipeline's region: the model dimension gathered over FSDP's axes,
    the ``n_shards`` vocabulary blocks split as the rules split the vocabulary, one chunk
    at a time. Left to the partitioner, the tokens split over dp met the columns split over
    dp on the contracted model dimension, and it summed each block's logits over dp at
    every (vocabulary chunk, token chunk): 32 GiB a step for llama3_1b's 128k vocabulary on
    dp2 x pp2 x tp2."""
    spec = partition_spec(Axes((None, "vocab", None)), (1, n_shards, 1), mesh, rules)
    return functools.partial(jax.lax.with_sharding_constraint, shardings=NamedSharding(mesh, spec))


def vocab_shards(
    vocab: int, mesh: Mesh | AbstractMesh, rules: Mapping[str, MeshAxes], manual_pp: bool = False
) -> int:
    """How many ways the rules split a vocabulary of ``vocab`` ids over ``mesh`` (without
    ``pp`` where it is manual; 1 where they do not divide it, as `partition_spec` leaves it
    whole): the fused loss keeps a partial sum per shard, so that a chunk's columns never
    cross devices."""
    axes = [axis for axis in rule_axes("vocab", rules) if not (manual_pp and axis == "pp")]
    n_shards = math.prod(mesh.shape[axis] for axis in axes)
    return n_shards if vocab % n_shards == 0 else 1


def plain_cross_entropy(
    logits: Float[Array, "*batch seq vocab"], targets: Int[Array, "*batch seq"]
) -> tuple[Float[Array, "*batch seq"], Float[Array, "*batch seq"]]:
    """Each token's cross-entropy and log-sum-exp from materialised logits (the reference; an
    ignored target's cross-entropy is its logits' against id 0, for the caller to mask)."""
    with jax.named_scope("loss"):
        token_losses = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.maximum(targets, 0)
        )
        return token_losses, jax.nn.logsumexp(logits, axis=-1)


def total_loss(
    token_losses: Float[Array, "*batch seq"],
    log_normalizers: Float[Array, "*batch seq"],
    weights: Float[Array, "*batch seq"],
    normalizer: Float[Array, ""],
    aux: dict[str, Array],
    config: StepConfig,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """``(loss, metrics)``: each per-token term summed over the target tokens (``weights``)
    and divided by ``normalizer``, and the model's aux values, weighted
    (`eqxzoo.train.loss_terms.weighted_loss`)."""
    parts = {
        term.name: jnp.sum(weights * term.per_token(token_losses, log_normalizers)) / normalizer
        for term in token_terms(config.loss)
    }
    return weighted_loss(parts, aux, config.loss)


def pipelined_loss_and_grad(
    model: LanguageModel,
    tokens: Int[Array, "microbatches batch seq"],
    targets: Int[Array, "microbatches batch seq"],
    *,
    config: StepConfig,
    mesh: Mesh | AbstractMesh,
    normalizer: Float[Array, ""] | None = None,
    documents: Documents | None = None,
) -> tuple[tuple[Float[Array, ""], dict[str, Array]], PyTree]:
    """``((loss, metrics), grads)`` of `pipelined_loss` by the 1F1B-family executor
    (`eqxzoo.parallel.pipeline_value_and_grad`), which runs the backward itself.

    The embedding (and prefix) run on the first virtual stage and the head and loss on the
    last, one microbatch at a time, so no ``(microbatches, ...)`` activation exists.
    ``grads`` has ``model``'s structure (the pipeline layout), with None for non-float leaves.
    """
    model = cast_floats(model, config.precision.compute)
    outer = eqx.tree_at(lambda m: m.blocks.layers, model, None)
    n_micro = tokens.shape[0]
    normalizer = default_normalizer(targets, normalizer)
    n_layers = model.blocks.n_layers
    tokens, targets, documents, _ = in_context_order(tokens, targets, documents, mesh)
    context = ContextSplit(CONTEXT_AXIS) if splits_context(mesh) else None

    def first(outer, tokens, documents):
        # Inside the executor's region: a shard of each sequence where cp splits them.
        if documents is not None:
            positions = documents.positions
        else:
            positions = None if context is None else context.positions(tokens.shape[-1])
        h = outer.embed(tokens, positions)
        if outer.prefix is not None:
            h, _ = outer.prefix(h, documents=documents)
        return h

    # On one stage of a dense model the executor has no region (`RegionAxes`): its loss is
    # the partitioner's, as outside a pipeline.
    in_region = bool(
        RegionAxes.of(
            mesh, model.blocks.layers, config.rules, pipelined=config.schedule.stages > 1
        ).manual
    )

    def last(outer, h, targets):
        token_losses, log_normalizers = token_cross_entropy(
            outer, h, targets, config, mesh, manual_pp=in_region
        )
        weights = target_mask(targets)
        return jnp.stack(
            [
                jnp.sum(weights * term.per_token(token_losses, log_normalizers)) / normalizer
                for term in terms
            ]
        )

    terms = token_terms(config.loss)

    def aux_loss(layer_sums):
        means = {name: value / n_layers for name, value in layer_sums.items()}
        return weighted_aux_loss(means, config.loss) / n_micro

    with jax.named_scope("pipeline"):
        loss_parts, layer_aux, layer_grads, outer_grads = pipeline_value_and_grad(
            model.blocks.layers,
            outer,
            tokens,
            targets,
            documents=documents,
            first=first,
            last=last,
            part_weights=[term.weight(config.loss) for term in terms],
            aux_loss=aux_loss,
            schedule=config.schedule,
            mesh=mesh,
            remat_policy=model.blocks.remat_policy,
            remat_stages=config.remat_stages,
            rules=config.rules,
            bubble_fill=config.bubble_fill,
        )
    aux = batch_aux_metrics(summarize_microbatches(layer_aux), config)
    grads = eqx.tree_at(
        lambda m: m.blocks.layers, outer_grads, layer_grads, is_leaf=lambda x: x is None
    )
    parts = {term.name: part for term, part in zip(terms, loss_parts)}
    return weighted_loss(parts, aux, config.loss), grads
