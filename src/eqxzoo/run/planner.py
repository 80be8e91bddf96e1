"""The planner: the mesh, schedule and microbatching to run a config on ``N`` devices.

`search` walks every candidate a run could take on ``N`` devices in ``S`` slices: each
factorisation of the devices over ``dp x pp x tp x ep x cp`` (with ``dp`` or ``pp`` spanning
the slices), each schedule with its repeats, each split of the global batch into gradient
accumulation steps ``G`` and microbatches ``M``, stage remat on and off and each layer remat
policy. The run's own rules judge each (`RunConfig` validation: the reason a candidate is
refused is its `ConfigError`'s line); what they accept is priced by two models fast enough
for hundreds of thousands of candidates:

- **Memory per device** (`memory_terms`, `MEMORY_MODEL`): the train state's bytes exactly
  (every parameter and optimizer statistic, sharded by the run's rules on the candidate's
  mesh), the batch, and the compiled step's temporaries as a sum of terms, each a byte count
  of something the step holds (gradients, the schedule's stash of microbatch activations,
  one chunk's layer residuals, the head's logits chunk, FSDP-gathered weights), weighted by
  coefficients fitted to `compiled.memory_analysis()` over `CALIBRATION` (`fit_memory_model`).
- **Step time** (`step_time`): compute from the step's matrix FLOPs (model, recomputation)
  over the accelerator's peak; the bubble from the schedule's lockstep model priced with the
  model's measured action FLOPs (`eqxzoo.parallel.action_costs`); communication from the
  bytes each mesh axis's collectives move (`collective_bytes`, checked against the compiled
  HLO's own accounting, `eqxzoo.parallel.collectives`) over the link it runs on (within a
  slice or across), tensor, expert and context collectives exposed, data and pipeline
  transfers overlapped with compute up to its length.

The best candidates are then compiled on abstract shapes (`confirm`), their compiled memory
shown beside the prediction; one that does not fit, or (on CPU) cannot skip its bubbles, is
dropped for the next.
"""

import dataclasses
import functools
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from eqxzoo.nn import Axes
from eqxzoo.nn.blockwise import BlockCounts, block_counts
from eqxzoo.nn.context import context_calls
from eqxzoo.nn.grouped import resolve_implementation
from eqxzoo.nn.mlp import GATED
from eqxzoo.optim import trainable_mask
from eqxzoo.parallel.mesh import MESH_AXES, DcnConfig, MeshConfig
from eqxzoo.parallel.pipeline import pools_one_stage, transport_dtype
from eqxzoo.parallel.pipeline_grad import sends_per_tick
from eqxzoo.parallel.rules import partition_spec
from eqxzoo.parallel.schedule import SCHEDULES, Costs, Schedule, ScheduleError
from eqxzoo.run.config import (
    ConfigError,
    PipelineConfig,
    RunConfig,
    model_config_for_mesh,
    run_model_config,
    step_config,
)
from eqxzoo.run.provenance import batches_carry_documents
from eqxzoo.train.loss import vocab_shards
from eqxzoo.train.memory import StepMemory
from eqxzoo.train.report import PEAK_FLOPS
from eqxzoo.train.state import _state_shape_and_axes
from eqxzoo.typed_config import refuse
from models import (
    DecoderConfig,
    attention_flops_per_key,
    attention_flops_per_token,
    flops_per_token,
    model_factory,
    parameter_counts,
)

GIB = 2**30
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """A chip as the planner prices it: dense bf16 peak FLOP/s, memory, and the bandwidth
    (GB/s, one direction, per device) of the links within a slice (ICI, NVLink) and across
    slices (DCN, the cluster network's share of one device)."""

    name: str
    peak_flops: float
    memory_gib: float
    ici_gbps: float
    dcn_gbps: float


ACCELERATORS = {
    accelerator.name: accelerator
    for accelerator in (
        Accelerator("H100", PEAK_FLOPS["H100"], 80.0, 450.0, 50.0),
        Accelerator("H200", PEAK_FLOPS["H200"], 141.0, 450.0, 50.0),
        Accelerator("A100", PEAK_FLOPS["A100"], 80.0, 300.0, 25.0),
        Accelerator("B200", PEAK_FLOPS["B200"], 180.0, 900.0, 50.0),
        Accelerator("TPU v5e", PEAK_FLOPS["TPU v5e"], 16.0, 200.0, 3.125),
        Accelerator("TPU v5p", PEAK_FLOPS["TPU v5p"], 95.0, 600.0, 6.25),
        Accelerator("TPU v6e", PEAK_FLOPS["TPU v6"], 32.0, 448.0, 6.25),
    )
}

# Layer remat policies a candidate may take (`models.DecoderConfig.remat`).
REMAT_POLICIES = ("none", "dots", "full")
MAX_MICROBATCHES = 64
MAX_REPEATS = 4


# ----------------------------------------------------------------------------- candidates


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for first in divisors(n):
        for rest in factorisations(n // first, parts - 1):
            yield (first, *rest)


def meshes(base: RunConfig, devices: int, slices: int) -> Iterator[MeshConfig | str]:
    """Every mesh of ``devices`` over `MESH_AXES` in ``slices`` slices (``dp`` or ``pp``
    spanning them); a mesh `MeshConfig` refuses comes as its reason. ``ep`` only where the
    model has experts (a dense model is refused it by a rule of its own: no need to list
    every such mesh)."""
    if devices % slices != 0:
        refuse("--slices", f"{slices} slices do not divide {devices} devices")
    moe = base.model.moe is not None
    for dcn_dp, dcn_pp in factorisations(slices, 2):
        for dp, pp, tp, ep, cp in factorisations(devices // slices, 5):
            if ep > 1 and not moe:
                continue
            try:
                yield MeshConfig(
                    dp=dp * dcn_dp,
                    pp=pp * dcn_pp,
                    tp=tp,
                    ep=ep,
                    cp=cp,
                    dcn=DcnConfig(dp=dcn_dp, pp=dcn_pp),
                )
            except ConfigError as error:
                yield str(error)


def schedule_choices(pp: int) -> Iterator[tuple[str, int] | str]:
    """``(schedule, repeats)`` pairs `Schedule` takes on ``pp`` stages (repeats up to
    `MAX_REPEATS`; ``circular`` with one repeat is GPipe's table and left out), or the
    reason it refuses a pair whatever the microbatches; one stage runs GPipe alone (plain
    gradient accumulation over microbatches)."""
    if pp == 1:
        yield ("gpipe", 1)
        return
    for name in SCHEDULES:
        for repeats in range(1, MAX_REPEATS + 1):
            if name == "circular" and repeats == 1:
                continue
            try:
                Schedule(name, stages=pp, microbatches=pp * repeats, repeats=repeats)
            except ScheduleError as error:
                if error.field == "repeats":
                    yield f"pipeline.repeats: {error.problem}"
                    continue
            yield (name, repeats)


def batch_splits(global_batch: int) -> list[tuple[int, int]]:
    """``(G, M)`` splits of ``global_batch`` sequences per step (``B = global / (G M)``),
    with at most `MAX_MICROBATCHES` microbatches."""
    return [
        (accumulation, microbatches)
        for accumulation in divisors(global_batch)
        for microbatches in divisors(global_batch // accumulation)
        if microbatches <= MAX_MICROBATCHES
    ]


def with_plan(
    base: RunConfig,
    mesh: MeshConfig,
    schedule: str,
    repeats: int,
    grad_accum: int,
    microbatches: int,
    remat_stages: bool | None = None,
    remat: str | None = None,
) -> RunConfig:
    """``base`` on ``mesh`` with the schedule and batch split (and the remat, where given;
    else the base's); `RunConfig` checks it."""
    global_batch = base.global_batch_size
    model = base.model if remat is None else dataclasses.replace(base.model, remat=remat)
    return dataclasses.replace(
        base,
        mesh=mesh,
        pipeline=PipelineConfig(
            schedule=schedule,
            microbatches=microbatches,
            repeats=repeats,
            remat_stages=base.pipeline.remat_stages if remat_stages is None else remat_stages,
        ),
        data=dataclasses.replace(
            base.data,
            batch_size=global_batch // (grad_accum * microbatches),
            grad_accum=grad_accum,
        ),
        model=model,
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """A candidate the run's rules accept: ``config`` (checked, with the base's remat) run
    with stage remat ``remat_stages`` and layer remat ``remat`` (which no rule refuses: set
    by `run_config`, not checked again for each candidate)."""

    config: RunConfig
    remat_stages: bool
    remat: str

    @property
    def schedule(self) -> Schedule:
        """`RunConfig.schedule`, with this plan's stage remat."""
        return self.config.schedule.for_stage_remat(self.remat_stages)

    def run_config(self) -> RunConfig:
        """The run config of this plan, as `pipelines.run` takes it."""
        config = self.config
        return with_plan(
            config,
            config.mesh,
            config.pipeline.schedule,
            config.pipeline.repeats,
            config.data.grad_accum,
            config.pipeline.microbatches,
            self.remat_stages,
            self.remat,
        )

    @property
    def label(self) -> str:
        """``dp8 pp2 tp4 | zb_h1 R1 G1 M8 B4 | stage remat, layers dots``."""
        stage = "stage remat" if self.remat_stages else "no stage remat"
        return (
            f"{mesh_label(self.config.mesh)} | {schedule_label(self.config)} | {stage}, "
            f"layers {self.remat}"
        )


@dataclasses.dataclass(frozen=True)
class Refused:
    """A candidate the run would not take, and why (one line)."""

    label: str
    mesh: MeshConfig | None
    reason: str


def mesh_label(mesh: MeshConfig) -> str:
    axes = " ".join(f"{axis}{size}" for axis, size in zip(MESH_AXES, mesh.shape) if size > 1)
    dcn = " ".join(f"dcn.{axis}{size}" for axis, size in zip(MESH_AXES, mesh.dcn.shape) if size > 1)
    return " ".join(part for part in (axes or "1 device", dcn) if part)


def schedule_label(config: RunConfig) -> str:
    pipeline, data = config.pipeline, config.data
    return (
        f"{pipeline.schedule} R{pipeline.repeats} G{data.grad_accum} M{pipeline.microbatches} "
        f"B{data.batch_size}"
    )


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=8,pp=2"`` or ``"dp8 pp2 dcn.dp2"`` -> ``{"dp": 8, "pp": 2, "dcn.dp": 2}``."""
    sizes = {}
    for axis, size in re.findall(r"((?:dcn\.)?[a-z]+)\s*=?\s*(\d+)", text):
        if axis.removeprefix("dcn.") not in MESH_AXES:
            refuse("--explain", f"unknown mesh axis {axis!r}; the axes are {list(MESH_AXES)}")
        sizes[axis] = int(size)
    if not sizes:
        refuse("--explain", f"expected a mesh such as 'dp=8,pp=2', got {text!r}")
    return sizes


def mesh_matches(mesh: MeshConfig, sizes: Mapping[str, int]) -> bool:
    """Whether ``mesh`` has the sizes ``sizes`` names (the unnamed axes at 1)."""
    for axis in MESH_AXES:
        if getattr(mesh, axis) != sizes.get(axis, 1):
            return False
        if getattr(mesh.dcn, axis) != sizes.get(f"dcn.{axis}", 1):
            return False
    return True


def mesh_refusal(base: RunConfig, mesh: MeshConfig) -> str | None:
    """Why the run refuses ``mesh`` whatever the schedule and batch split (the model does not
    split over it, the sequence does not split over cp), or None: `RunConfig` judges a plan
    of one microbatch per stage and one sequence per data device, and a refusal that names
    anything but the pipeline or the batch size is the mesh's."""
    data_devices = mesh.dp * mesh.ep
    probe = dataclasses.replace(base.data, batch_size=data_devices, grad_accum=1)
    try:
        dataclasses.replace(
            base,
            mesh=mesh,
            pipeline=PipelineConfig(schedule="gpipe", microbatches=mesh.pp),
            data=probe,
        )
    except ConfigError as error:
        if error.field is None or not (
            error.field.startswith("pipeline.") or error.field == "data.batch_size"
        ):
            return str(error)
    return None


def candidates(base: RunConfig, devices: int, slices: int) -> Iterator[Plan | Refused]:
    """Every plan of `meshes` x `schedule_choices` x `batch_splits` x stage remat x layer
    remat that the run's rules accept, and a `Refused` for each mesh, (mesh, schedule) or
    plan they refuse."""
    global_batch = base.global_batch_size
    splits = batch_splits(global_batch)
    remats = [(remat_stages, remat) for remat_stages in (True, False) for remat in REMAT_POLICIES]
    for mesh in meshes(base, devices, slices):
        if isinstance(mesh, str):
            yield Refused("mesh", None, mesh)
            continue
        reason = mesh_refusal(base, mesh)
        if reason is not None:
            yield Refused(mesh_label(mesh), mesh, reason)
            continue
        for choice in schedule_choices(mesh.pp):
            if isinstance(choice, str):
                yield Refused(mesh_label(mesh), mesh, choice)
                continue
            schedule, repeats = choice
            for grad_accum, microbatches in splits:
                try:
                    config = with_plan(base, mesh, schedule, repeats, grad_accum, microbatches)
                except ConfigError as error:
                    label = (
                        f"{mesh_label(mesh)} | {schedule} R{repeats} G{grad_accum} M{microbatches}"
                    )
                    yield Refused(label, mesh, str(error))
                    continue
                for remat_stages, remat in remats:
                    if mesh.pp == 1 and remat_stages:
                        continue
                    yield Plan(config, remat_stages, remat)


# ----------------------------------------------------------------------------- the model's facts


@dataclasses.dataclass(frozen=True)
class StateLeaf:
    """One array of the train state: its shape, bytes per element and logical axes."""

    shape: tuple[int, ...]
    itemsize: int
    axes: Axes
    trainable_parameter: bool

    @property
    def names(self) -> tuple[str | None, ...]:
        return tuple(self.axes.names)

    @property
    def layered(self) -> bool:
        return "stages" in self.names


# Backends whose compiled step computes a 16-bit layer in float32 and keeps what it computes
# so: XLA:CPU keeps a layer's matmul outputs ("dots" residuals twice what JAX traces in
# bfloat16), and, without remat, its elementwise intermediates too (llama3_1b's "none" stash
# 1.28x, DeepSeek-small's 1.55x the bfloat16 trace with its matmul outputs widened).
WIDENS_COMPUTE = ("cpu",)


def layer_residual_bytes(
    model: DecoderConfig, seq_len: int, dtype, sequences: int = 1
) -> dict[str, int]:
    """Bytes one block of ``model`` (built without a context or expert axis) keeps for its
    backward on ``sequences`` sequences of ``seq_len`` tokens in ``dtype``, on abstract
    shapes: under each layer remat policy, the residuals of its pullback as JAX traces it
    (its weights not counted, `eqxzoo.parallel.backward_split.PullbackResiduals`; what it
    computes from them is), in float32 what the backend computes and keeps so
    (`WIDENS_COMPUTE`), and (``"w_stash/" + policy``) what a split backward's B hands
    its W (`BackwardSplit`)."""
    from eqxzoo.nn.stack import remat, run_layer
    from eqxzoo.parallel.backward_split import BackwardSplit, PullbackResiduals

    make_model = model_factory(model)
    blocks = eqx.filter_eval_shape(lambda key: make_model(key=key), jax.random.key(0)).blocks.layers

    def floating(leaf) -> bool:
        return isinstance(leaf, jax.ShapeDtypeStruct) and jnp.issubdtype(leaf.dtype, jnp.inexact)

    def integer(leaf) -> bool:
        return isinstance(leaf, jax.ShapeDtypeStruct) and not floating(leaf)

    def size(leaves) -> int:
        return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in leaves)

    def traced(dtype, policies) -> dict[str, int]:
        one = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape[1:], dtype if floating(s) else s.dtype), blocks
        )
        weights, rest = eqx.partition(one, floating)
        data, static = eqx.partition(rest, integer)
        h = jax.ShapeDtypeStruct((sequences, seq_len, model.d_model), dtype)
        kept = {}
        for policy in policies:
            layer = remat(lambda w, d, x: run_layer(eqx.combine(w, d, static), x), policy)

            def measure(w, d, x, layer=layer, policy=policy):
                outputs, pullback = jax.vjp(lambda w, x: layer(w, d, x), w, x)
                cotangent = jax.tree.map(jnp.zeros_like, outputs)
                split = BackwardSplit.of_pullback(pullback, w, x, cotangent)[0]
                kept[policy] = size(PullbackResiduals.of_pullback(pullback, w).shapes)
                kept[f"w_stash/{policy}"] = size(v.aval for v in split.stash)

            jax.eval_shape(measure, weights, data, h)
        return kept

    kept = traced(dtype, REMAT_POLICIES)
    if jnp.dtype(dtype).itemsize < 4 and jax.default_backend() in WIDENS_COMPUTE:
        # What "dots" keeps is the matmuls' outputs and the layer's input (in ``dtype``).
        layer_input = sequences * seq_len * model.d_model * jnp.dtype(dtype).itemsize
        kept["dots"] += kept["dots"] - layer_input
        kept["none"] = traced(jnp.float32, ("none",))["none"] - layer_input
    return kept


def split_widths(model: DecoderConfig) -> DecoderConfig:
    """``model`` with the widths tensor parallelism splits halved (heads, the MLPs' and the
    experts' hidden widths), each head as wide: one of two tp devices' share of a layer."""
    moe = model.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, expert_mlp_dim=moe.expert_mlp_dim // 2, shared_mlp_dim=moe.shared_mlp_dim // 2
        )
    kv_heads = model.kv_heads // 2 if model.kv_heads % 2 == 0 else model.kv_heads
    return dataclasses.replace(
        model,
        n_heads=model.n_heads // 2,
        n_kv_heads=kv_heads,
        head_dim=model.attention_head_dim,
        mlp_dim=model.mlp_dim // 2,
        moe=moe,
    )


@functools.lru_cache(maxsize=1024)
def layer_model(model: DecoderConfig, mesh: MeshConfig) -> DecoderConfig:
    """``model``'s layer as a run builds it on ``mesh`` (its MoE kernel is the mesh's), on
    one device's share: without its context and expert axes."""
    on_mesh = model_config_for_mesh(model, mesh)
    return dataclasses.replace(on_mesh, context_axis=None, expert_axis=None)


class Kept(NamedTuple):
    """What a block keeps for its backward (`layer_residuals`), bytes: ``per_token`` and
    ``constant`` (what does not grow with the sequences: mostly what the block computes from
    its weights, such as a MoE kernel's transposed expert matrices), each as ``(whole,
    split)``: what every tp device keeps, and what tp splits (a device keeps ``split /
    tp``)."""

    per_token: tuple[float, float]
    constant: tuple[float, float]


@functools.lru_cache(maxsize=64)
def layer_residuals(model: DecoderConfig, seq_len: int, dtype: str) -> dict[str, Kept]:
    """`Kept` per layer remat policy (`layer_residual_bytes`): the per-token and constant
    parts from one and two sequences, the whole and split parts from the block at its own
    widths and at half of them (`split_widths`)."""

    def linear(model: DecoderConfig) -> dict[str, tuple[float, float]]:
        one, two = (
            layer_residual_bytes(model, seq_len, jnp.dtype(dtype), sequences)
            for sequences in (1, 2)
        )
        return {
            kind: ((two[kind] - one[kind]) / seq_len, float(2 * one[kind] - two[kind]))
            for kind in one
        }

    def whole_and_split(full: float, half: float) -> tuple[float, float]:
        return 2 * half - full, 2 * (full - half)

    full = linear(model)
    if model.n_heads < 2:
        return {kind: Kept((t, 0.0), (c, 0.0)) for kind, (t, c) in full.items()}
    half = linear(split_widths(model))
    return {
        kind: Kept(
            whole_and_split(full[kind][0], half[kind][0]),
            whole_and_split(full[kind][1], half[kind][1]),
        )
        for kind in full
    }


@dataclasses.dataclass(frozen=True, eq=False)
class ModelFacts:
    """What pricing needs of ``config``'s model, computed once: the train state's arrays
    (`StateLeaf`), the model as a run builds it on one device (``model``; what its layers
    keep, `layer_residuals`, is measured per mesh), per-token widths of a layer's
    activations (elements; ``tp_input_width``: the inputs of a layer's tp-split projections,
    whose gradients each reduce over tp), the bytes of an element computed and of one sent
    between stages (`eqxzoo.parallel.pipeline.transport_dtype`), the FLOPs of a training
    token (and of its attention: over the keys it sees, and over all of them, as the dense
    kernel computes it), the share of the blocks' matmul weights in their last
    projection (the MLP's down, the experts' active ones) and the int32 arrays a batch
    carries per token (tokens and targets; with packed documents, their segments and
    positions too)."""

    leaves: tuple[StateLeaf, ...]
    model: DecoderConfig
    compute_dtype: str
    d_model: int
    n_blocks: int
    n_layers: int
    vocab: int
    compute_bytes: int
    transport_bytes: int
    kv_width: int
    tp_input_width: int
    attention_layers: int
    moe_layers: int
    top_k: int
    n_experts: int
    expert_hidden: int
    block_flops_share: float
    flops_per_token: float
    attention_flops_per_token: float
    scores_flops_per_token: float
    last_projection_share: float
    prefix_flops_share: float
    pools_one_stage: bool
    batch_arrays: int

    @classmethod
    def of(cls, config: RunConfig) -> "ModelFacts":
        one_device = with_plan(
            dataclasses.replace(config, mesh=MeshConfig()),
            MeshConfig(),
            "gpipe",
            1,
            1,
            1,
        )
        settings = step_config(one_device)
        make_model = model_factory(run_model_config(one_device))
        shapes, axes = _state_shape_and_axes(make_model, settings)
        trainable = trainable_mask(shapes.model, settings.optimizer.freeze)
        parameters = eqx.tree_at(
            lambda state: state.model,
            jax.tree.map(lambda _: False, shapes),
            trainable,
        )
        leaves = []
        flat_axes = jax.tree.leaves(axes, is_leaf=lambda a: hasattr(a, "names"))
        flat_shapes = jax.tree.leaves(shapes)
        flat_trainable = jax.tree.leaves(parameters)
        for shape, leaf_axes, is_trainable in zip(
            flat_shapes, flat_axes, flat_trainable, strict=True
        ):
            leaves.append(
                StateLeaf(
                    shape=tuple(shape.shape),
                    itemsize=jnp.dtype(shape.dtype).itemsize,
                    axes=leaf_axes,
                    trainable_parameter=bool(is_trainable),
                )
            )
        model = config.model
        d, tokens_flops = model.d_model, flops_per_token(model, config.data.seq_len)
        latent = model.latent_attention
        heads = model.n_heads
        if latent is None:
            kv_width = 2 * model.kv_heads * model.attention_head_dim
            attention_inputs = 3 * d  # q, k and v each read the layer's input
        else:
            qk = latent.qk_nope_head_dim + latent.qk_rope_head_dim
            kv_width = heads * (qk + latent.v_head_dim)
            attention_inputs = (latent.q_lora_rank or d) + latent.kv_lora_rank
        mlp_inputs = (2 if model.activation in GATED else 1) * d
        moe = model.moe
        moe_layers = 0 if moe is None else model.n_blocks
        top_k, n_experts = (1, 1) if moe is None else (moe.top_k, moe.n_experts)
        expert_hidden = 0 if moe is None else moe.expert_mlp_dim
        counts = parameter_counts(model)
        head = model.vocab_size * d
        block_params = counts.active - counts.embedding - (0 if model.tie_embeddings else head)
        share = 6 * block_params / (6 * (block_params + head))
        if moe is None:
            down = model.n_layers * model.mlp_dim
        else:
            routed = moe.top_k * moe.expert_mlp_dim + moe.shared_mlp_dim
            down = model.first_dense_layers * model.mlp_dim + model.n_blocks * routed
        return cls(
            leaves=tuple(leaves),
            model=one_device.adapted_model,
            compute_dtype=jnp.dtype(config.precision.compute).name,
            d_model=d,
            n_blocks=model.n_blocks,
            n_layers=model.n_layers,
            vocab=model.vocab_size,
            compute_bytes=jnp.dtype(config.precision.compute).itemsize,
            transport_bytes=transport_dtype(jnp.dtype(config.precision.compute)).itemsize,
            kv_width=kv_width,
            tp_input_width=attention_inputs + mlp_inputs,
            attention_layers=model.n_layers,
            moe_layers=moe_layers,
            top_k=top_k,
            n_experts=n_experts,
            expert_hidden=expert_hidden,
            block_flops_share=share,
            flops_per_token=tokens_flops,
            attention_flops_per_token=attention_flops_per_token(model, config.data.seq_len),
            scores_flops_per_token=(
                attention_flops_per_key(model) * model.n_layers * config.data.seq_len
            ),
            last_projection_share=down * d / block_params,
            prefix_flops_share=model.first_dense_layers / model.n_layers,
            pools_one_stage=pools_one_stage(shapes.model),
            batch_arrays=4 if batches_carry_documents(config) else 2,
        )

    def residual_bytes(self, remat: str, config: RunConfig, tokens: int) -> float:
        """Bytes a layer keeps for its backward on ``tokens`` tokens of a device under layer
        remat ``remat`` on ``config``'s mesh: its pullback's residuals (`layer_residuals` of
        the layer the run builds there, on a cp device's share of each sequence)."""
        return self._kept(remat, config, tokens)

    def w_stash_bytes(self, remat: str, config: RunConfig, tokens: int) -> float:
        """Bytes a layer's B hands its W in a split backward, likewise."""
        return self._kept(f"w_stash/{remat}", config, tokens)

    def _kept(self, kind: str, config: RunConfig, tokens: int) -> float:
        """``tokens`` times the per-token part of `Kept`, plus its constant part split as
        the step holds the layer's weights: whole over the data axes in a pipeline's
        region, as the state splits them on one stage."""
        mesh = config.mesh
        model = layer_model(self.model, mesh)
        kept = layer_residuals(model, config.data.seq_len // mesh.cp, self.compute_dtype)[kind]
        (token_whole, token_split), (constant_whole, constant_split) = kept
        weights = state_bytes(self, config)
        held = weights.layer if self.pooled(mesh) else weights.layer_sharded
        constant = (constant_whole + constant_split / mesh.tp) * held / max(weights.layer_tp, 1)
        return tokens * (token_whole + token_split / mesh.tp) + constant

    def pooled(self, mesh: MeshConfig) -> bool:
        """Whether the pipeline's region on ``mesh`` is manual over the batch's axes, holding
        its layers' weights whole over them: on several stages, and on one where the experts
        dispatch (`eqxzoo.parallel.pipeline.pools_one_stage`)."""
        return mesh.pp > 1 or self.pools_one_stage

    def expert_rows(self, config: RunConfig) -> float:
        """Bytes of the buffers a dropless MoE layer's sorted kernel fills where
        `jax.lax.ragged_dot` is not native (XLA:CPU): every local expert's block over every
        row the device received, for the hidden and the output widths."""
        model = layer_model(self.model, config.mesh)
        if model.moe is None or model.moe.dropless_kernel != "sorted":
            return 0.0
        if resolve_implementation("auto") == "ragged_dot":
            return 0.0
        rows = tokens_per_microbatch(config) * self.top_k * config.mesh.ep
        experts = self.n_experts / config.mesh.ep
        return experts * rows * (2 * self.expert_hidden / config.mesh.tp + self.d_model) * 4


def abstract_mesh(mesh: MeshConfig) -> AbstractMesh:
    return AbstractMesh(mesh.axis_shape, mesh.axis_names)


class StateBytes(NamedTuple):
    """Bytes per device of a train state on a mesh: the whole ``state``, its ``trainable``
    parameters, and of those as a pipeline's region holds them (whole over the data axes,
    dp and ep but for the experts' own weights; the outer ones over pp too): one
    ``layer``'s and the ``outer`` (not layered) ones, and among them (``*_gathered``) those
    the state splits over the data axes, which the region gathers at its boundary, and
    (``*_reduced``) those whole over a data axis or cp in the region, whose gradients it sums;
    one layer's as the state splits them (``layer_sharded``) and split over tp only
    (``layer_tp``); of ``layer``, the experts' own weights (``layer_experts``); of
    ``outer_gathered`` and ``outer_reduced``, the head's (the tied embedding, where it is
    the head: ``head_gathered``, ``head_reduced``) and an untied embedding's
    (``embedding_gathered``, ``embedding_reduced``)."""

    state: int
    trainable: int
    layer: int
    outer: int
    layer_gathered: int
    outer_gathered: int
    layer_reduced: int
    outer_reduced: int
    layer_sharded: int
    layer_tp: int
    layer_experts: int
    head_gathered: int
    head_reduced: int
    embedding_gathered: int
    embedding_reduced: int


@functools.lru_cache(maxsize=4096)
def _state_bytes(facts: ModelFacts, mesh: MeshConfig, rules_key: tuple) -> StateBytes:
    """`StateBytes` of ``facts``' train state on ``mesh`` under the rules ``rules_key``
    names."""
    rules = dict(rules_key)
    on_mesh = abstract_mesh(mesh)
    sizes = dict(zip(mesh.axis_names, mesh.axis_shape, strict=True))
    data_axes = {axis for axis in mesh.axis_names if axis.startswith("dp")} | {"ep"}
    state = trainable = 0
    region = {"layer": 0, "outer": 0}
    gathered = {"layer": 0, "outer": 0}
    reduced = {"layer": 0, "outer": 0}
    layer_sharded = layer_tp = layer_experts = 0
    head_gathered = head_reduced = embedding_gathered = embedding_reduced = 0
    tied = facts.model.tie_embeddings
    for leaf in facts.leaves:
        spec = partition_spec(leaf.axes, leaf.shape, on_mesh, rules)
        experts = "experts" in leaf.names
        own_experts = experts and mesh.ep > 1
        whole_over = {a for a in data_axes if not (a == "ep" and own_experts)}
        split_axes = [
            axis for part in spec for axis in ((part,) if isinstance(part, str) else part or ())
        ]
        shards = math.prod(sizes[axis] for axis in split_axes)
        # The region holds the outer weights whole over pp too (a stage's layers are its own).
        in_region = math.prod(
            sizes[axis] for axis in split_axes if axis not in whole_over and axis != "pp"
        )
        elements = math.prod(leaf.shape)
        pp = mesh.pp if leaf.layered else 1
        per_device = elements * leaf.itemsize // (shards * pp)
        state += per_device
        if not leaf.trainable_parameter:
            continue
        trainable += per_device
        kind, count = ("layer", facts.n_blocks) if leaf.layered else ("outer", 1)
        if leaf.layered:
            layer_sharded += elements * leaf.itemsize // (shards * count)
            tp_shards = math.prod(sizes[axis] for axis in split_axes if axis == "tp")
            layer_tp += elements * leaf.itemsize // (tp_shards * count)
        size = elements * leaf.itemsize // (in_region * count)
        region[kind] += size
        if leaf.layered and experts:
            layer_experts += size
        table = not leaf.layered and "vocab" in leaf.names
        head = table and (tied or leaf.names[-1] == "vocab")
        embedding = table and not head
        if any(axis in whole_over for axis in split_axes):
            gathered[kind] += size
            head_gathered += size if head else 0
            embedding_gathered += size if embedding else 0
        # No weight is split over cp, whose devices hold different tokens: each sums its
        # gradients with the others there too.
        if any(sizes[axis] > 1 for axis in (*whole_over, "cp")):
            reduced[kind] += size
            head_reduced += size if head else 0
            embedding_reduced += size if embedding else 0
    return StateBytes(
        state,
        trainable,
        region["layer"],
        region["outer"],
        gathered["layer"],
        gathered["outer"],
        reduced["layer"],
        reduced["outer"],
        layer_sharded,
        layer_tp,
        layer_experts,
        head_gathered,
        head_reduced,
        embedding_gathered,
        embedding_reduced,
    )


def state_bytes(facts: ModelFacts, config: RunConfig) -> StateBytes:
    """`_state_bytes` of ``config``'s mesh and sharding rules."""
    rules = config.sharding.rules_on(config.mesh.axis_names)
    return _state_bytes(facts, config.mesh, tuple(sorted(rules.items())))


# ----------------------------------------------------------------------------- memory

# The temporaries' terms (`memory_terms`), each a byte count, and the weight the compiled
# step gives each: fitted by `fit_memory_model` to `compiled.memory_analysis()` over
# `CALIBRATION` (the bytes beyond the state and batch).
MEMORY_TERMS = (
    "gradients",
    "stash",
    "tick_stash",
    "chunk_residuals",
    "fused_residuals",
    "layer_peak",
    "logits",
    "chunk_weights",
    "region_weights",
    "expert_rows",
    "tick_weights",
    "tick_expert_weights",
    "split_backward",
)
# Fitted 2026-11-30 by `fit_memory_model` to the 43 configs' compiled MiB as `python -m
# pipelines.plan --calibrate` prints them: within 10% of the compiled step on 37 of them,
# -26% to +19% over all; each predicted by the model fitted to the other 42, 25 of them
# (README, "Plan a run").
MEMORY_MODEL: dict[str, float] = {
    "gradients": 2.598,
    "stash": 0.590,
    "tick_stash": 0.912,
    "chunk_residuals": 1.060,
    "fused_residuals": 1.671,
    "layer_peak": 0.907,
    "logits": 0.707,
    "chunk_weights": 0.108,
    "region_weights": 1.287,
    "expert_rows": 0.327,
    "tick_weights": 0.852,
    "tick_expert_weights": 0.810,
    "split_backward": 1.278,
}


def tokens_per_microbatch(config: RunConfig) -> int:
    """Tokens of one microbatch on one device: its sequences over ``dp x ep``, its tokens
    over ``cp``."""
    mesh = config.mesh
    return config.data.batch_size // (mesh.dp * mesh.ep) * (config.data.seq_len // mesh.cp)


def memory_terms(facts: ModelFacts, plan: Plan) -> tuple[int, dict[str, float]]:
    """``(state and batch bytes, {term: bytes})`` per device of ``plan``'s step: the first
    exact, the terms what `MEMORY_MODEL` weighs into the temporaries."""
    config, mesh = plan.config, plan.config.mesh
    weights = state_bytes(facts, config)
    state, trainable, layer_weights = weights.state, weights.trainable, weights.layer
    tokens = tokens_per_microbatch(config)
    batch = 2 * 4 * config.data.grad_accum * config.pipeline.microbatches * tokens
    schedule = plan.schedule
    chunk_layers = facts.n_blocks // (mesh.pp * schedule.repeats)
    chunk = chunk_layers * facts.residual_bytes(plan.remat, config, tokens)
    item = tokens * facts.d_model * facts.compute_bytes if plan.remat_stages else chunk
    # The 1F1B family's last stage runs the head on each microbatch as it comes; the
    # forward schedules run it after the pipeline on all of them, pp acting as a data axis.
    head_tokens = (
        tokens if schedule.fuses_backward else config.pipeline.microbatches * tokens / mesh.pp
    )
    logits_columns = min(config.loss.chunk_size, facts.vocab / (mesh.tp))
    ticks_kept = (
        _in_flight(schedule) * chunk_layers
        if not schedule.fuses_backward
        and not plan.remat_stages
        and facts.pooled(mesh)
        and schedule.forward_only.ticks > 1
        else 0
    )
    # A pooled region sums its stage's gradients whole over the data axes; where none shards
    # them (dp x ep of 1), that sum is the step's gradient, not a buffer beside it (llama3_1b
    # circular R4 compiled 1,983 MiB more on pp4 x cp2 than on dp2 x pp4, its state 1,768
    # more: a second copy of the gradients would have added 2,868).
    region_sums_them = int(facts.pooled(mesh) and mesh.dp * mesh.ep == 1)
    terms = {
        # Accumulated over several steps (G), a step's gradients and their running sum; none
        # beside a region's sum that is the gradient itself.
        "gradients": trainable * ((2 if config.data.grad_accum > 1 else 1) - region_sums_them),
        # What waits for its backward: the 1F1B family's slots, each stage input or chunk's
        # residuals; under autodiff of a forward schedule's tick loop, each tick's, stacked
        # (`_stacked_ticks`).
        "stash": _in_flight(schedule) * item if schedule.fuses_backward else 0,
        "tick_stash": 0 if schedule.fuses_backward else _stacked_ticks(schedule) * item,
        # A forward schedule's stage remat recomputes one chunk's residuals in its backward.
        "chunk_residuals": chunk if plan.remat_stages and not schedule.fuses_backward else 0,
        "fused_residuals": chunk if schedule.fuses_backward else 0,
        # One layer's backward: everything it computes, kept or recomputed.
        "layer_peak": facts.residual_bytes("none", config, tokens),
        "logits": min(head_tokens, config.loss.chunk_size) * logits_columns * 4
        + head_tokens * facts.d_model * 4,
        "chunk_weights": chunk_layers * layer_weights,
        # A pooled region holds its stage's weights whole over the data axes, and on several
        # stages the outer ones too, and accumulates their gradients so.
        "region_weights": (
            facts.n_blocks // mesh.pp * layer_weights + (weights.outer if mesh.pp > 1 else 0)
            if facts.pooled(mesh)
            else 0
        ),
        "expert_rows": facts.expert_rows(config),
        # Autodiff of a forward schedule's tick loop keeps the weights each tick's chunk ran
        # with where the region holds them whole (on several stages its conditional outputs
        # them as residuals; with stage remat, the stage only): DeepSeek-small on one stage
        # of dp16 over 8 microbatches compiled to 39 GiB where the model had 11 without them.
        # A circular stage runs one of its R chunks a tick, and keeps that chunk's: llama3_1b
        # circular R4 on pp4 stacks one layer's weights a tick, not its stage's four.
        # The experts' weights apart: their kernels keep them in float32 and the compute
        # dtype both, where a dense layer keeps most of its weights in the compute dtype
        # only (DeepSeek-small on one stage keeps 1.2x its chunk's float32 weights a tick,
        # llama3_1b 0.7-0.8x).
        "tick_weights": ticks_kept * (layer_weights - weights.layer_experts),
        "tick_expert_weights": ticks_kept * weights.layer_experts,
        "split_backward": (
            _in_flight(schedule) * chunk_layers * facts.w_stash_bytes(plan.remat, config, tokens)
            if schedule.splits_backward
            else 0
        ),
    }
    return state + batch, {name: float(value) for name, value in terms.items()}


@functools.lru_cache(maxsize=4096)
def _in_flight(schedule: Schedule) -> int:
    """The items a stage stashes at once: the 1F1B family's slots; under autodiff of a
    forward schedule's tick loop, a tick's each (a bubble's zeros too)."""
    return schedule.in_flight() if schedule.fuses_backward else schedule.forward_only.ticks


@functools.lru_cache(maxsize=4096)
def _stacked_ticks(schedule: Schedule) -> int:
    """The items autodiff of a forward schedule's tick loop holds: each tick's, stacked, and
    one more (a tick's, beside the stack, as it is written in or read back); one tick runs
    without a loop, and holds its own."""
    ticks = schedule.forward_only.ticks
    return ticks + 1 if ticks > 1 else 1


@functools.lru_cache(maxsize=4096)
def _bubble(schedule: Schedule, costs: Costs) -> float:
    return schedule.bubble_fraction(costs)


def predicted_memory(
    facts: ModelFacts, plan: Plan, model: Mapping[str, float] | None = None
) -> int:
    """Bytes per device `memory_terms` and ``model`` (default `MEMORY_MODEL`) predict."""
    return weighed(*memory_terms(facts, plan), MEMORY_MODEL if model is None else model)


def weighed(exact: int, terms: Mapping[str, float], model: Mapping[str, float]) -> int:
    """The bytes ``exact`` plus ``terms`` weighed by ``model``."""
    return int(exact + sum(model[name] * value for name, value in terms.items()))


# ----------------------------------------------------------------------------- time


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A step's predicted time on the accelerator, seconds: ``compute`` (its FLOPs at peak),
    ``bubble`` (the stages' idle time), ``ici`` and ``dcn`` (communication left exposed
    within and across slices); ``mfu`` the model FLOPs over the step's time at peak."""

    compute: float
    bubble: float
    ici: float
    dcn: float
    mfu: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.ici + self.dcn


# Wire bytes per buffer byte of each collective on ``n`` devices (ring algorithms): what a
# device sends of the buffer `eqxzoo.parallel.collectives` sizes.
WIRE_FACTOR: dict[str, Callable[[int], float]] = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def step_flops(facts: ModelFacts, plan: Plan) -> tuple[float, float]:
    """``(model FLOPs of the step, FLOPs one device runs)``: the model's training FLOPs
    (`models.flops_per_token`, attention over the keys each query sees), and a device's
    share of what the step runs: the blocks' forwards run again (stage remat: each stage's,
    which with ``"full"`` layer remat is the layers' inputs only: none of a one-layer chunk,
    all of a scan over several, whose last layer's is not dead code there; ``"full"``: each
    layer's own, but its last projection's, whose output its backward does not read), the
    head's logits, which the chunked loss's backward computes again block by block, and
    attention as its kernel runs it. The blockwise kernel computes the block pairs that may
    hold a visible key (`attention_share` of the scores, about half when causal), its
    backward five matmuls a pair where autodiff of the dense kernel runs four; ``"dots"``
    layer remat runs either kernel's forward again (it saves no batched matmul's output,
    nor one inside a loop)."""
    config, mesh = plan.config, plan.config.mesh
    tokens = config.tokens_per_step
    model_flops = facts.flops_per_token * tokens
    rest = model_flops - facts.attention_flops_per_token * tokens
    chunk_layers = facts.n_blocks // (mesh.pp * plan.schedule.repeats)
    full = plan.remat == "full"
    stage_again = float(plan.remat_stages and (not full or chunk_layers > 1))
    again = stage_again + (1 - facts.last_projection_share if full else 0)
    # Every score's FLOPs are 12 units: the forward's two matmuls (4), the backward's four
    # (8; the blockwise kernel's five, 10, recompute the scores).
    share = attention_share(facts.model, config.data.seq_len, mesh.cp)
    share, backward = (1.0, 8) if share is None else (share, 10)
    forwards = 1 + stage_again + (1 if plan.remat in ("full", "dots") else 0)
    scores = facts.scores_flops_per_token * tokens
    attention_run = share * scores / 12 * (4 * forwards + backward)
    head_again = 2 * facts.vocab * facts.d_model * tokens if config.loss.chunk_size else 0
    device = rest * (1 + again * facts.block_flops_share / 3) + attention_run + head_again
    return model_flops, device / config.mesh.size


def collective_bytes(facts: ModelFacts, plan: Plan) -> dict[tuple[str, str], float]:
    """``{(kind, axis): buffer bytes}`` one device's collectives move in a step, as
    `eqxzoo.parallel.collectives` sizes them (a buffer each, not wire bytes): tensor
    parallelism's all-reduces of each layer's outputs (two a layer each forward, one for a
    layer's own remat, which stops at what its backward reads) and of the gradient of each
    split projection's input (the partitioner reduces q's, k's and v's apart, not their
    sum), and the vocabulary-split embedding's and head's; context parallelism's ring (keys,
    values and positions, ``cp`` shifts each forward and backward, the backward's with their
    gradients), expert parallelism's all-to-alls (two each way a MoE layer), the
    pipeline's sends (one a tick each way), and over the data axes (dp and ep, under
    ``"dp"``): on one stage FSDP's gathers of the weights (each pass) and the gradients'
    reduce-scatter, on several the region's gather of its weights and sum of their
    gradients, once each accumulation step."""
    config, mesh = plan.config, plan.config.mesh
    tokens = tokens_per_microbatch(config)
    microbatches = config.pipeline.microbatches * config.data.grad_accum
    passes = 3 + (1 if plan.remat_stages else 0) + (1 if plan.remat == "full" else 0)
    stage_layers = facts.n_layers / mesh.pp
    activation = tokens * facts.d_model * facts.compute_bytes
    traffic: dict[tuple[str, str], float] = {}
    if mesh.tp > 1:
        # Each forward reduces the attention's and the MLP's outputs; a layer's own remat
        # recomputes only up to what its backward reads, not the MLP's output.
        outputs = 2 * (1 + plan.remat_stages) + (1 if plan.remat == "full" else 0)
        inputs = tokens * facts.tp_input_width * facts.compute_bytes
        per_layer = outputs * activation + inputs
        ends = 2 if mesh.pp == 1 else 1  # the vocab-split embedding's and head's reductions
        traffic[("all-reduce", "tp")] = microbatches * (
            stage_layers * per_layer + ends * activation
        )
    if mesh.cp > 1:
        # The ring (`eqxzoo.nn.context`) shifts a device's keys and values with their
        # positions ``cp`` times each forward (the stage's and the layer's remat run it
        # again; "dots" keeps no output of it), and in the backward shifts them again with
        # their float32 gradients, ``cp`` times.
        keys_values = tokens * facts.kv_width / mesh.tp
        positions = config.data.seq_len // mesh.cp * 4
        forwards = 1 + plan.remat_stages + (plan.remat != "none")
        shifted = (forwards + 1) * (keys_values * facts.compute_bytes + positions)
        per_layer = mesh.cp * (shifted + keys_values * 4)
        traffic[("collective-permute", "cp")] = stage_layers * microbatches * per_layer
    if mesh.ep > 1 and facts.moe_layers:
        # The forward, the backward and stage remat's forward each exchange a MoE layer's
        # tokens both ways; a layer's own remat runs the dispatch again ("dots" keeps no
        # output of it, "full" recomputes it), not the combine, whose output the layer's
        # backward does not read (as `full` leaves out the last projection).
        exchanges = 2 * (2 + plan.remat_stages) + (1 if plan.remat != "none" else 0)
        traffic[("all-to-all", "ep")] = (
            exchanges * facts.moe_layers / mesh.pp * microbatches * mesh.ep * activation
        )
    if mesh.pp > 1:
        # Activations and their cotangents cross stages in `transport_dtype`. The 1F1B
        # family sends a tick's through each of its ring's shifts (one on two stages); a
        # forward schedule's tick sends up the ring, its transpose down, and the last
        # stage's outputs go to every stage for the loss (their cotangents back).
        sent = activation // facts.compute_bytes * facts.transport_bytes
        ticks = plan.schedule.ticks * config.data.grad_accum
        if plan.schedule.fuses_backward:
            sends = ticks * sends_per_tick(plan.schedule)
        else:
            sends = 2 * ticks + 2 * microbatches
        traffic[("collective-permute", "pp")] = sends * sent
    weights = state_bytes(facts, config)
    trainable, layer_weights = weights.trainable, weights.layer
    data = mesh.dp * mesh.ep
    rules = config.sharding.rules_on(mesh.axis_names)
    on_mesh = abstract_mesh(mesh)
    # Outside the region the vocabulary is split over pp too
    # (`eqxzoo.train.loss.vocab_shards`): a device sums only its share of the table there.
    outside_share = vocab_shards(facts.vocab, on_mesh, rules, manual_pp=True) / vocab_shards(
        facts.vocab, on_mesh, rules
    )
    if data * mesh.cp > 1 and facts.pooled(mesh):
        # A step gathers the stage's and the outer weights whole over the data axes once
        # (the region its stage's, and the 1F1B family's the outer ones it
        # runs inside; the forward schedules' embedding and head run outside, gathered
        # there), and sums their gradients over those axes and cp once. Outside the region the head's
        # vocabulary is split over pp too (`eqxzoo.train.loss.vocab_shards`): a device sums
        # its columns' gradient only; and the partitioner looks an untied embedding's rows
        # up where they are (all-to-alls of the tokens), neither gathering the table nor
        # summing its gradient.
        layers = facts.n_blocks // mesh.pp
        gathered = layers * weights.layer_gathered + weights.outer_gathered
        reduced = layers * weights.layer_reduced + weights.outer_reduced
        if not plan.schedule.fuses_backward:
            # Each use of the table outside gathers a device's vocabulary share of it: the
            # loss's columns and, where it is tied, the embedding's lookup.
            uses = 2 if facts.model.tie_embeddings else 1
            reduced -= (1 - outside_share) * weights.head_reduced + weights.embedding_reduced
            gathered -= (1 - uses * outside_share) * weights.head_gathered
            gathered -= weights.embedding_gathered
        elif mesh.dcn.dp > 1:
            # Across slices, each slice's region takes the tables split over pp as the rules
            # split them (`eqxzoo.train.step.layout_within_slice`): a device gathers and sums
            # its share over dp, not the whole table.
            tables = weights.head_gathered + weights.embedding_gathered
            gathered -= (1 - outside_share) * tables
            reduced -= (1 - outside_share) * (weights.head_reduced + weights.embedding_reduced)
        if plan.schedule.fuses_backward and data > mesh.dcn.dp:
            # The 1F1B family's executor takes each stage's ids tick by tick, whole over the
            # data axes of its slice, and splits them over its own
            # (`eqxzoo.parallel.pipeline_grad`): a slice's share of the batch gathered each
            # accumulation step (ZB-H1 on dp2 x pp4 gathers 3.4 MiB so).
            sequences = config.data.batch_size // mesh.dcn.dp
            ids = plan.schedule.ticks * mesh.pp * sequences * config.data.seq_len
            gathered += config.data.grad_accum * facts.batch_arrays * 4 * ids
        # The weights do not change between accumulation steps: XLA gathers them once a
        # step, out of the accumulation loop (GPipe and ZB-H1 at G 2 gathered half the
        # bytes of one gather a step each).
        traffic[("all-gather", "dp")] = gathered
        traffic[("all-reduce", "dp")] = config.data.grad_accum * reduced
    elif data > 1:
        # FSDP on one stage: each pass gathers a layer's weights as it runs it, and each
        # run of the loss the head's columns in its forward and again in its backward (the
        # 1F1B family's a microbatch's, a forward schedule's the step's). The gradients
        # are reduce-scattered as they are made: the 1F1B family's each microbatch, a
        # forward schedule's layers at each tick of its loop, its outer ones once.
        whole = trainable * data
        layers_whole = facts.n_blocks * weights.layer_tp
        if plan.schedule.fuses_backward:
            losses, reduced = microbatches, microbatches * whole
        else:
            accumulated = config.data.grad_accum
            losses = accumulated
            per_step = config.pipeline.microbatches  # the tick loop's length on one stage
            reduced = accumulated * (per_step * layers_whole + whole - layers_whole)
        gathered = (passes - 1) * microbatches * stage_layers * layer_weights
        traffic[("all-gather", "dp")] = gathered + 2 * losses * weights.head_gathered
        traffic[("reduce-scatter", "dp")] = reduced
    elif mesh.cp > 1:
        # One stage split over cp alone holds every weight whole on each device, and sums
        # the gradients over cp once an accumulation step (the ticks' sums are one).
        traffic[("all-reduce", "dp")] = config.data.grad_accum * trainable
    if mesh.cp > 1 and not plan.schedule.fuses_backward:
        # The embedding outside the region looks up each device's own tokens, and the
        # partitioner sums the table's gradient over cp there, apart from the head's sum in
        # the loss: a tied table is summed twice (one sum would do; see "Plan a run").
        table = weights.head_reduced if facts.model.tie_embeddings else weights.embedding_reduced
        summed = config.data.grad_accum * outside_share * table
        traffic[("all-reduce", "dp")] = traffic.get(("all-reduce", "dp"), 0.0) + summed
    return {key: float(size) for key, size in traffic.items()}


def step_time(facts: ModelFacts, plan: Plan, accelerator: Accelerator, costs: Costs) -> StepTime:
    """`StepTime` of ``plan`` on ``accelerator``s, the bubble priced with ``costs``."""
    mesh = plan.config.mesh
    model_flops, device_flops = step_flops(facts, plan)
    compute = device_flops / accelerator.peak_flops
    pipelined = compute * facts.block_flops_share
    bubble_fraction = _bubble(plan.schedule, costs) if mesh.pp > 1 else 0.0
    bubble = pipelined * bubble_fraction / (1 - bubble_fraction)
    exposed = {"ici": 0.0, "dcn": 0.0}
    overlapped = {"ici": 0.0, "dcn": 0.0}
    for (kind, axis), size in collective_bytes(facts, plan).items():
        # The gradients' sums over the data axes span cp too (`collective_bytes`).
        data = mesh.dp * mesh.ep * (mesh.cp if kind == "all-reduce" else 1)
        group = data if axis == "dp" else getattr(mesh, axis, 1)
        across = {"dp": mesh.dcn.dp, "pp": mesh.dcn.pp}.get(axis, 1) > 1
        link = "dcn" if across else "ici"
        bandwidth = (accelerator.dcn_gbps if across else accelerator.ici_gbps) * GB
        seconds = size * WIRE_FACTOR[kind](group) / bandwidth
        if axis in ("dp", "pp"):
            overlapped[link] += seconds
        else:
            exposed[link] += seconds
    for link in exposed:
        exposed[link] += max(0.0, overlapped[link] - compute)
    total = compute + bubble + exposed["ici"] + exposed["dcn"]
    mfu = model_flops / (total * mesh.size * accelerator.peak_flops)
    return StepTime(compute, bubble, exposed["ici"], exposed["dcn"], mfu)


# ----------------------------------------------------------------------------- compiling


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the compiled step of a plan says of itself: its memory per device
    (`StepMemory`), its optimized HLO and its matrix FLOPs per device
    (`eqxzoo.parallel.collectives.matmul_flops`: each loop iteration counted, where XLA's cost
    analysis counts a loop's body once; a pipeline's conditionals by how often the schedule
    runs their branches, `executed_branches`)."""

    memory: StepMemory
    hlo: str
    flops: float
    skips_bubbles: bool


def compile_plan(config: RunConfig) -> Compiled:
    """``config``'s train step compiled on abstract shapes (nothing is initialised), as the
    run compiles it but without refusing a step XLA:CPU cannot run (`skips_bubbles` says
    whether the stages could skip their bubbles there: no collective-permute in a branch)."""
    from eqxzoo.parallel import make_mesh
    from eqxzoo.parallel.collectives import matmul_flops, permutes_in_branches
    from eqxzoo.run.loop import batch_shape
    from eqxzoo.train.state import abstract_train_state
    from eqxzoo.train.step import compile_train_step

    mesh = make_mesh(config.mesh)
    settings = step_config(config)
    state = abstract_train_state(
        model_factory(run_model_config(config)), config=settings, mesh=mesh
    )
    compiled = compile_train_step(
        settings,
        mesh,
        state,
        batch_shape(config).shape,
        documents=batches_carry_documents(config),
        refuse_deadlocks=False,
    )
    hlo = compiled.as_text()
    return Compiled(
        memory=StepMemory.of(compiled),
        hlo=hlo,
        flops=matmul_flops(
            hlo, executed_branches(plan_of(config).schedule), attention_loop_trips(config)
        ),
        skips_bubbles=config.mesh.pp == 1 or not permutes_in_branches(hlo),
    )


def prepared_step(config: RunConfig) -> Callable[[], jax.Array]:
    """``config``'s train step, compiled as the run compiles it, on a fresh state and a batch
    of random tokens (no packed documents) on this host's devices: each call runs one step
    and returns its loss. What `step_time` predicts, to time or profile."""
    from eqxzoo.parallel import make_mesh
    from eqxzoo.run.loop import batch_shape
    from eqxzoo.train.state import init_train_state
    from eqxzoo.train.step import batch_sharding, compile_train_step

    mesh = make_mesh(config.mesh)
    settings = step_config(config)
    model = run_model_config(config)
    state = init_train_state(
        model_factory(model), jax.random.key(config.run.seed), config=settings, mesh=mesh
    )
    shape = batch_shape(config).shape
    step = compile_train_step(settings, mesh, state, shape)
    tokens = jax.random.randint(jax.random.key(1), shape, 0, model.vocab_size)
    batch = jax.device_put(
        {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=-1)},
        batch_sharding(mesh, settings.rules),
    )

    def train_step() -> jax.Array:
        nonlocal state
        state, metrics = step(state, batch)
        return metrics["loss"]

    return train_step


def measured_step_seconds(config: RunConfig, repeats: int) -> float:
    """The median wall time, seconds, of ``config``'s `prepared_step` over ``repeats`` steps
    after a warm-up one."""
    from eqxzoo.train.report import median_seconds

    return median_seconds(prepared_step(config), repeats=repeats)


def attention_loop_trips(config: RunConfig) -> dict[str, float] | None:
    """How often each loop of the blockwise attention runs (`BlockCounts.loop_trips`: its
    block plan over the run's positions, ``0 .. seq - 1``, as cp splits them), where the
    layers attend alike; None where they do not (layers of different windows) or the
    kernel has no loops."""
    model = config.model
    windows = set(model.layer_windows or (0,))
    if len(windows) > 1:
        return None
    blocks = attention_blocks(model, config.data.seq_len, windows.pop(), config.mesh.cp)
    return None if blocks is None else blocks.loop_trips(batches_carry_documents(config))


def attention_blocks(
    model: DecoderConfig, seq: int, window: int, shards: int = 1
) -> BlockCounts | None:
    """`BlockCounts` of ``model``'s attention over ``seq`` tokens with ``window``, each
    sequence split over ``shards`` (cp: always blockwise, `eqxzoo.nn.context`), or None
    where the kernel is dense (chosen, or every key in one block: `choose_kernel`)."""
    if shards == 1 and (model.attention_kernel == "dense" or seq <= model.attention_block_size):
        return None
    groups = 1 if model.latent_attention is not None else model.n_heads // model.kv_heads
    strategy = model.context_parallel if shards > 1 else None
    return _block_counts(seq, shards, strategy, groups, window, model.attention_block_size)


def attention_share(model: DecoderConfig, seq: int, shards: int = 1) -> float | None:
    """The share of its scores ``model``'s attention kernel computes over ``seq`` tokens
    split over ``shards``, the mean over its layers (`BlockCounts.share`), or None for the
    dense kernel (all of them)."""
    if attention_blocks(model, seq, 0, shards) is None:
        return None
    windows = model.layer_windows or (0,)
    return float(
        np.mean([attention_blocks(model, seq, window, shards).share for window in windows])
    )


@functools.lru_cache(maxsize=256)
def _block_counts(
    seq: int, shards: int, strategy: str | None, groups: int, window: int, block_size: int
) -> BlockCounts:
    if strategy is None:
        q_positions = k_positions = np.arange(seq)[None]
    else:
        q_positions, k_positions = context_calls(seq, shards, strategy)
    return block_counts(
        q_positions, k_positions, groups=groups, window=window, block_size=block_size
    )


def executed_branches(schedule: Schedule) -> Callable[[str], list[float] | None]:
    """How often, on average over the stages, each branch of the pipeline's conditionals runs
    a tick, from a conditional's HLO line (its op_name): an action's (`action_scope`) by its
    share of the action table's cells, a forward schedule's stage (`STAGE_SCOPE`, forward and
    backward) by its active share of the forward table, the head (`HEAD_SCOPE`) in one F of
    every ``P R``. Other conditionals count their dearest branch once."""
    from eqxzoo.parallel.pipeline import STAGE_SCOPE
    from eqxzoo.parallel.pipeline_grad import HEAD_SCOPE, action_scope
    from eqxzoo.parallel.schedule import ACTION_NAMES

    actions = schedule.actions().action
    shares = {action_scope(kind): float(np.mean(actions == kind)) for kind in ACTION_NAMES}
    busy = schedule.microbatches * schedule.repeats
    shares[STAGE_SCOPE] = busy / schedule.forward_only.ticks
    shares[HEAD_SCOPE] = 1 / (schedule.stages * schedule.repeats)

    def runs(line: str) -> list[float] | None:
        name = re.search(r'op_name="([^"]*)/cond"', line)
        scope = name.group(1).rsplit("/", 1)[-1] if name else None
        if scope not in shares:
            return None
        return [1 - shares[scope], shares[scope]]

    return runs


def plan_of(config: RunConfig) -> Plan:
    """``config`` as a `Plan` (its own remat)."""
    return Plan(config, config.pipeline.remat_stages, config.model.remat)


# The configs `calibrate` fits `MEMORY_MODEL` to: (config file, --set overrides), on 8
# devices, small enough to compile in seconds, over the families, meshes, schedules and
# remat policies the terms tell apart.
SMALL = ("data.seq_len=256", "run.steps=10", "optimizer.warmup_steps=2")
LLAMA = (
    "configs/llama3_1b.toml",
    (
        *SMALL,
        "model.n_layers=8",
        "model.d_model=256",
        "model.n_heads=8",
        "model.n_kv_heads=4",
        "model.mlp_dim=1024",
        "model.vocab_size=8192",
        "data.vocab_size=2048",
        "data.batch_size=8",
        "data.grad_accum=1",
    ),
)
DEEPSEEK = (
    "configs/deepseek_small.toml",
    (
        *SMALL,
        "model.d_model=256",
        "model.n_layers=9",
        "model.vocab_size=8192",
        "data.vocab_size=2048",
        "data.batch_size=8",
    ),
)
TINY = ("configs/tiny.toml", ("run.steps=10", "optimizer.warmup_steps=2"))
# At the real widths, where the weights and a layer's activations are in a run's proportions.
LLAMA_WIDE = (
    "configs/llama3_1b.toml",
    (
        "run.steps=10",
        "optimizer.warmup_steps=2",
        "model.n_layers=4",
        "data.seq_len=2048",
        "data.batch_size=8",
        "data.grad_accum=1",
    ),
)
DEEPSEEK_WIDE = (
    "configs/deepseek_small.toml",
    ("run.steps=10", "optimizer.warmup_steps=2", "model.n_layers=3", "data.batch_size=8"),
)

# At the configs' own depths and sequence lengths too, as the planner's tables price them.
LLAMA_FULL = (
    "configs/llama3_1b.toml",
    ("run.steps=10", "optimizer.warmup_steps=2", "data.batch_size=8", "data.grad_accum=1"),
)
DEEPSEEK_FULL = (
    "configs/deepseek_small.toml",
    ("run.steps=10", "optimizer.warmup_steps=2", "data.grad_accum=1"),
)


def _variant(base: tuple[str, tuple[str, ...]], *overrides: str) -> tuple[str, tuple[str, ...]]:
    return base[0], (*base[1], *overrides)


def _one_stage_dp8(
    base: tuple[str, tuple[str, ...]], *overrides: str
) -> tuple[str, tuple[str, ...]]:
    """``base`` as the search prices one stage: GPipe over dp8, no stage remat."""
    return _variant(
        base,
        "mesh.dp=8",
        "mesh.pp=1",
        "mesh.ep=1",
        "pipeline.schedule=gpipe",
        "pipeline.repeats=1",
        "pipeline.remat_stages=false",
        *overrides,
    )


CALIBRATION: tuple[tuple[str, tuple[str, ...]], ...] = (
    _variant(LLAMA, "mesh.dp=4", "mesh.pp=2", "pipeline.schedule=zb_h1", "pipeline.microbatches=4"),
    _variant(
        LLAMA,
        "mesh.dp=4",
        "mesh.pp=2",
        "pipeline.schedule=1f1b",
        "pipeline.microbatches=8",
        "pipeline.remat_stages=false",
    ),
    _variant(
        LLAMA,
        "mesh.dp=2",
        "mesh.pp=2",
        "mesh.tp=2",
        "pipeline.schedule=gpipe",
        "pipeline.microbatches=4",
    ),
    _variant(
        LLAMA,
        "mesh.dp=2",
        "mesh.pp=4",
        "pipeline.schedule=circular",
        "pipeline.repeats=2",
        "pipeline.microbatches=4",
        "model.remat=full",
    ),
    _variant(
        LLAMA,
        "mesh.dp=1",
        "mesh.pp=4",
        "mesh.tp=2",
        "pipeline.schedule=interleaved_1f1b",
        "pipeline.repeats=2",
        "pipeline.microbatches=8",
        "data.batch_size=4",
    ),
    _variant(LLAMA, "mesh.dp=8", "mesh.pp=1", "pipeline.microbatches=2", "model.remat=none"),
    _variant(
        LLAMA, "mesh.dp=2", "mesh.pp=1", "mesh.tp=4", "pipeline.microbatches=1", "model.remat=dots"
    ),
    _variant(
        LLAMA,
        "mesh.dp=2",
        "mesh.pp=2",
        "mesh.cp=2",
        "pipeline.schedule=1f1b",
        "pipeline.microbatches=4",
    ),
    _variant(
        LLAMA,
        "mesh.dp=2",
        "mesh.pp=2",
        "mesh.tp=2",
        "pipeline.schedule=zb_v",
        "pipeline.repeats=2",
        "pipeline.microbatches=4",
        "data.batch_size=2",
    ),
    _variant(
        LLAMA,
        "mesh.dp=4",
        "mesh.pp=2",
        "pipeline.schedule=gpipe",
        "pipeline.microbatches=2",
        "data.grad_accum=2",
        "pipeline.remat_stages=false",
        "model.remat=full",
    ),
    _variant(
        LLAMA,
        "mesh.dp=2",
        "mesh.pp=4",
        "pipeline.schedule=zb_h1",
        "pipeline.microbatches=8",
        "pipeline.remat_stages=false",
        "model.remat=dots",
        "data.seq_len=512",
    ),
    _variant(
        LLAMA,
        "mesh.dp=4",
        "mesh.pp=2",
        "pipeline.schedule=1f1b",
        "pipeline.microbatches=4",
        "model.d_model=512",
        "model.mlp_dim=2048",
    ),
    _variant(
        DEEPSEEK,
        "mesh.dp=2",
        "mesh.pp=2",
        "mesh.ep=2",
        "pipeline.schedule=circular",
        "pipeline.repeats=2",
        "pipeline.microbatches=4",
    ),
    _variant(
        DEEPSEEK,
        "mesh.dp=1",
        "mesh.pp=2",
        "mesh.ep=4",
        "pipeline.schedule=1f1b",
        "pipeline.repeats=1",
        "pipeline.microbatches=4",
    ),
    _variant(
        DEEPSEEK,
        "mesh.dp=4",
        "mesh.pp=2",
        "mesh.ep=1",
        "pipeline.schedule=zb_h1",
        "pipeline.repeats=1",
        "pipeline.microbatches=2",
        "pipeline.remat_stages=false",
    ),
    _variant(
        DEEPSEEK,
        "mesh.dp=2",
        "mesh.pp=1",
        "mesh.ep=4",
        "pipeline.schedule=gpipe",
        "pipeline.repeats=1",
        "pipeline.microbatches=2",
        "model.remat=full",
    ),
    _variant(TINY, "mesh.dp=2", "mesh.pp=2", "mesh.tp=2"),
    _variant(
        TINY,
        "mesh.dp=1",
        "mesh.pp=4",
        "mesh.tp=1",
        "mesh.ep=2",
        "pipeline.schedule=1f1b",
        "pipeline.repeats=1",
        "pipeline.microbatches=4",
    ),
    _variant(
        TINY,
        "mesh.dp=2",
        "mesh.pp=2",
        "mesh.tp=1",
        "mesh.ep=2",
        "pipeline.schedule=zb_h1",
        "pipeline.repeats=1",
        "pipeline.microbatches=4",
        "pipeline.remat_stages=true",
    ),
    _variant(
        TINY,
        "mesh.dp=4",
        "mesh.pp=1",
        "mesh.tp=2",
        "pipeline.schedule=gpipe",
        "pipeline.repeats=1",
        "pipeline.microbatches=4",
    ),
    _variant(
        TINY,
        "mesh.dp=2",
        "mesh.pp=2",
        "mesh.tp=1",
        "mesh.cp=2",
        "pipeline.schedule=interleaved_1f1b",
        "pipeline.microbatches=4",
        "pipeline.remat_stages=true",
        "model.remat=dots",
    ),
    _variant(
        TINY,
        "mesh.dp=8",
        "mesh.pp=1",
        "mesh.tp=1",
        "pipeline.schedule=gpipe",
        "pipeline.repeats=1",
        "pipeline.microbatches=1",
        "data.seq_len=512",
    ),
    _variant(
        LLAMA,
        "mesh.dp=2",
        "mesh.pp=2",
        "mesh.tp=2",
        "mesh.dcn.dp=2",
        "pipeline.schedule=1f1b",
        "pipeline.microbatches=4",
    ),
    _variant(
        LLAMA,
        "mesh.dp=4",
        "mesh.pp=2",
        "mesh.dcn.pp=2",
        "pipeline.schedule=zb_h1",
        "pipeline.microbatches=8",
        "data.batch_size=4",
    ),
    _variant(
        LLAMA_WIDE, "mesh.dp=8", "mesh.pp=1", "pipeline.schedule=gpipe", "pipeline.microbatches=2"
    ),
    _variant(
        LLAMA_WIDE, "mesh.dp=4", "mesh.pp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=4"
    ),
    _variant(
        LLAMA_WIDE,
        "mesh.dp=2",
        "mesh.pp=2",
        "mesh.tp=2",
        "pipeline.schedule=zb_h1",
        "pipeline.microbatches=4",
    ),
    _variant(
        LLAMA_WIDE,
        "mesh.dp=2",
        "mesh.pp=2",
        "mesh.tp=2",
        "pipeline.schedule=circular",
        "pipeline.repeats=2",
        "pipeline.microbatches=4",
        "pipeline.remat_stages=false",
    ),
    _variant(
        LLAMA_WIDE,
        "mesh.dp=2",
        "mesh.pp=1",
        "mesh.tp=4",
        "pipeline.schedule=gpipe",
        "pipeline.microbatches=1",
        "model.remat=full",
    ),
    _variant(
        DEEPSEEK_WIDE,
        "mesh.dp=2",
        "mesh.pp=1",
        "mesh.ep=4",
        "pipeline.schedule=gpipe",
        "pipeline.repeats=1",
        "pipeline.microbatches=2",
    ),
    # One stage as the search prices it (no stage remat), at the real widths.
    _one_stage_dp8(LLAMA_WIDE, "pipeline.microbatches=1"),
    _one_stage_dp8(LLAMA_WIDE, "pipeline.microbatches=2", "model.remat=none"),
    _one_stage_dp8(DEEPSEEK_WIDE, "pipeline.microbatches=1"),
    _one_stage_dp8(LLAMA_FULL, "pipeline.microbatches=1"),
    _one_stage_dp8(LLAMA_FULL, "pipeline.microbatches=2"),
    _one_stage_dp8(DEEPSEEK_FULL, "pipeline.microbatches=1", "data.batch_size=64"),
    _one_stage_dp8(DEEPSEEK_WIDE, "pipeline.microbatches=2"),
    # Circular over four repeats without stage remat: each tick keeps one chunk's weights.
    _variant(
        LLAMA_FULL,
        "mesh.dp=4",
        "mesh.pp=2",
        "pipeline.schedule=circular",
        "pipeline.repeats=4",
        "pipeline.microbatches=2",
        "pipeline.remat_stages=false",
    ),
    # No layer remat on one stage, as the search ranks it first where it fits.
    _one_stage_dp8(DEEPSEEK_WIDE, "pipeline.microbatches=1", "model.remat=none"),
    _one_stage_dp8(LLAMA_FULL, "pipeline.microbatches=2", "model.remat=none"),
    # Circular on four stages over short sequences, the ticks' weights as large as their
    # activations (a 1,024-device search's plans), over dp, cp and dp alone.
    _variant(
        LLAMA_FULL,
        "mesh.dp=2",
        "mesh.pp=4",
        "pipeline.schedule=circular",
        "pipeline.repeats=4",
        "pipeline.microbatches=4",
        "pipeline.remat_stages=false",
        "data.seq_len=1024",
    ),
    _variant(
        LLAMA_FULL,
        "mesh.dp=1",
        "mesh.pp=4",
        "mesh.cp=2",
        "pipeline.schedule=circular",
        "pipeline.repeats=4",
        "pipeline.microbatches=4",
        "pipeline.remat_stages=false",
        "data.seq_len=2048",
        "data.batch_size=4",
    ),
    _variant(
        LLAMA_FULL,
        "mesh.dp=1",
        "mesh.pp=2",
        "mesh.cp=4",
        "pipeline.schedule=circular",
        "pipeline.repeats=4",
        "pipeline.microbatches=2",
        "pipeline.remat_stages=false",
    ),
)


@dataclasses.dataclass(frozen=True)
class CalibrationRow:
    """One calibration config: its label, the exact and modelled terms of its memory, its
    compiled memory, and its collectives' bytes predicted and compiled, by (kind, axis)."""

    label: str
    exact: int
    terms: dict[str, float]
    compiled: int
    compiled_temporaries: int
    bytes_predicted: dict[str, float]
    bytes_compiled: dict[str, float]
    flops_predicted: float
    flops_compiled: float
    moe: bool


def compiled_bytes_by_axis(
    compiled: Compiled, mesh: MeshConfig, schedule: Schedule | None = None
) -> dict[str, float]:
    """The compiled HLO's collective bytes (`eqxzoo.parallel.collectives.links`) by
    ``"kind over axes"``, ``dp_dcn`` and ``dp_ici`` read as ``dp``; with ``schedule``, each
    pipeline conditional's branches counted as often as it runs them (`executed_branches`:
    an expert layer's all-to-alls in F's and B's branches, not at every tick)."""
    from eqxzoo.parallel.collectives import links

    runs = None if schedule is None else executed_branches(schedule)
    by_axis: dict[str, float] = {}
    for link, traffic in links(compiled.hlo, mesh.axis_names, mesh.slice_indices(), runs).items():
        axes = sorted({"dp" if axis.startswith("dp") else axis for axis in link.axes})
        key = f"{link.kind} over {'+'.join(axes) or 'none'}"
        by_axis[key] = by_axis.get(key, 0.0) + traffic.bytes
    return by_axis


def data_axes_traffic(by_axis: Mapping[str, float]) -> dict[str, float]:
    """``by_axis`` (`compiled_bytes_by_axis`) with the gathers and reductions over the data
    axes (dp, ep, both: FSDP's, and a region's whole over them; a region's gradient sum over
    cp too) as ``"kind over dp"``, the key the planner predicts them under."""
    data_axes = {
        "all-gather": {"dp", "ep"},
        "reduce-scatter": {"dp", "ep"},
        "all-reduce": {"dp", "ep", "cp"},
    }
    merged: dict[str, float] = {}
    for key, size in by_axis.items():
        kind, axes = key.split(" over ")
        if set(axes.split("+")) <= data_axes.get(kind, set()):
            key = f"{kind} over dp"
        merged[key] = merged.get(key, 0.0) + size
    return merged


def calibration_row(config: RunConfig, label: str) -> CalibrationRow:
    facts = ModelFacts.of(config)
    plan = plan_of(config)
    compiled = compile_plan(config)
    exact, terms = memory_terms(facts, plan)
    predicted_bytes = {
        f"{kind} over {axis}": size for (kind, axis), size in collective_bytes(facts, plan).items()
    }
    return CalibrationRow(
        label=label,
        exact=exact,
        terms=terms,
        compiled=compiled.memory.total,
        compiled_temporaries=compiled.memory.temporaries,
        bytes_predicted=predicted_bytes,
        bytes_compiled=compiled_bytes_by_axis(compiled, config.mesh, plan.schedule),
        flops_predicted=step_flops(facts, plan)[1],
        flops_compiled=compiled.flops,
        moe=facts.moe_layers > 0,
    )


# The error within which `fit_memory_model` tries to bring every calibration config: a little
# inside the 10% a prediction is held to.
FIT_TOLERANCE = 0.095


def fit_memory_model(rows: list[CalibrationRow]) -> dict[str, float]:
    """`MEMORY_MODEL`'s weights: non-negative, minimising first the sum of the rows'
    relative errors past `FIT_TOLERANCE` (each counted only beyond it, and linearly), then,
    among the weights that reach that, the sum of the errors (two linear programs). Least
    squares spent the weights on the few configs the terms explain worst (squaring their
    errors) and left 27 of the 38 within 10%; this fit leaves 28."""
    from scipy.optimize import linprog

    scale = np.array([row.compiled for row in rows], float)
    matrix = np.array([[row.terms[name] for name in MEMORY_TERMS] for row in rows]) / scale[:, None]
    target = np.array([row.compiled - row.exact for row in rows], float) / scale
    n_rows, n_terms = matrix.shape
    # Variables: the weights, each row's |error| a_i and its excess e_i >= a_i - tolerance.
    eye, zeros = np.eye(n_rows), np.zeros((n_rows, n_rows))
    constraints = np.vstack(
        [
            np.hstack([matrix, -eye, zeros]),
            np.hstack([-matrix, -eye, zeros]),
            np.hstack([np.zeros((n_rows, n_terms)), eye, -eye]),
        ]
    )
    limits = np.concatenate([target, -target, np.full(n_rows, FIT_TOLERANCE)])
    excess = np.concatenate([np.zeros(n_terms + n_rows), np.ones(n_rows)])
    errors = np.concatenate([np.zeros(n_terms), np.ones(n_rows), np.zeros(n_rows)])
    least = linprog(excess, A_ub=constraints, b_ub=limits, bounds=(0, None)).fun
    solved = linprog(
        errors,
        A_ub=np.vstack([constraints, excess]),
        b_ub=np.append(limits, least + 1e-9 * n_rows),
        bounds=(0, None),
    )
    return {name: float(w) for name, w in zip(MEMORY_TERMS, solved.x[:n_terms], strict=True)}


def held_out_errors(rows: list[CalibrationRow]) -> list[float]:
    """Each row's relative error under the model fitted to the other rows: what the memory
    model makes of a config it was not fitted to."""
    errors = []
    for index, row in enumerate(rows):
        model = fit_memory_model(rows[:index] + rows[index + 1 :])
        errors.append(weighed(row.exact, row.terms, model) / row.compiled - 1)
    return errors


# ----------------------------------------------------------------------------- the search


@dataclasses.dataclass(frozen=True)
class Scored:
    """A plan that fits, with its predicted memory per device and step time."""

    plan: Plan
    memory: int
    time: StepTime


@dataclasses.dataclass
class Search:
    """What `search` found: the best plans that fit (fastest first, at most ``keep``), how
    many plans it priced and how many of those need more than the device's memory, and the
    refusals (the run's rules' and the memory's): each reason's count, and every refused
    plan whose mesh ``explain`` names."""

    ranked: list[Scored]
    priced: int
    over_memory: int
    refused: dict[str, int]
    explained: list[Refused]
    explained_fits: list[Scored]


def refusal_kind(reason: str) -> str:
    """A refusal's reason without its numbers, to count alike reasons together."""
    return re.sub(r"\d[\d,.]*", "N", reason.split(";")[0])[:110]


def search(
    base: RunConfig,
    devices: int,
    slices: int,
    accelerator: Accelerator,
    memory_gib: float,
    costs: Costs,
    *,
    keep: int = 50,
    explain: Mapping[str, int] | None = None,
    on_mesh: Callable[[int, int], None] = lambda done, total: None,
) -> Search:
    """Price every plan `candidates` yields; keep the ``keep`` fastest that fit in
    ``memory_gib`` per device (of equally fast ones, those that need the least memory). ``on_mesh(done, total)`` follows the progress over meshes."""
    import heapq

    facts = ModelFacts.of(base)
    limit = memory_gib * GIB
    total_meshes = sum(1 for _ in meshes(base, devices, slices))
    heap: list[tuple[float, int, int, Scored]] = []
    refused: dict[str, int] = {}
    explained: list[Refused] = []
    explained_fits: list[Scored] = []
    priced = over_memory = seen_meshes = 0
    last_mesh = None
    for candidate in candidates(base, devices, slices):
        mesh = candidate.config.mesh if isinstance(candidate, Plan) else candidate.mesh
        if mesh is not last_mesh:
            seen_meshes += 1
            last_mesh = mesh
            on_mesh(min(seen_meshes, total_meshes), total_meshes)
        wanted = explain is not None and mesh is not None and mesh_matches(mesh, explain)
        if isinstance(candidate, Refused):
            kind = refusal_kind(candidate.reason)
            refused[kind] = refused.get(kind, 0) + 1
            if wanted:
                explained.append(candidate)
            continue
        priced += 1
        memory = predicted_memory(facts, candidate)
        if memory > limit:
            over_memory += 1
            reason = (
                f"memory: needs {memory / GIB:.1f} GiB per device (predicted), over the "
                f"{memory_gib:g} GiB"
            )
            refused[refusal_kind(reason)] = refused.get(refusal_kind(reason), 0) + 1
            if wanted:
                explained.append(Refused(candidate.label, mesh, reason))
            continue
        scored = Scored(candidate, memory, step_time(facts, candidate, accelerator, costs))
        if wanted:
            explained_fits.append(scored)
        entry = (-scored.time.total, -memory, -priced, scored)
        if len(heap) < keep:
            heapq.heappush(heap, entry)
        elif entry > heap[0]:
            heapq.heapreplace(heap, entry)
    ranked = [entry[-1] for entry in sorted(heap, key=lambda entry: entry[:3], reverse=True)]
    explained_fits.sort(key=lambda scored: scored.time.total)
    return Search(ranked, priced, over_memory, refused, explained, explained_fits)


def measured_costs(base: RunConfig) -> tuple[Costs, str]:
    """The relative costs of a stage's actions (F, B, W, R) for ``base``'s model, from the
    matrix FLOPs of its traced ZB-H1 step on two stages (`eqxzoo.parallel.action_costs`),
    and where they came from; unit costs where the model cannot run two stages."""
    from eqxzoo.parallel import make_mesh
    from eqxzoo.parallel.action_costs import measured_action_flops
    from eqxzoo.run.plan import step_tracer
    from eqxzoo.train.state import abstract_train_state

    try:
        config = with_plan(base, MeshConfig(pp=2), "zb_h1", 1, 1, 2, True, base.model.remat)
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=1))
    except ConfigError as error:
        return Costs(), f"unit costs (two stages refused: {error})"
    if jax.device_count() < 2:
        return Costs(), "unit costs (one device: no stage to price)"
    mesh = make_mesh(config.mesh, jax.devices()[:2])
    settings = step_config(config)
    make_model = model_factory(run_model_config(config))
    state = abstract_train_state(make_model, config=settings, mesh=mesh)
    shape = (1, 2, 1, config.data.seq_len)
    flops = measured_action_flops(
        settings.schedule, step_tracer(settings, mesh, make_model, state, shape)
    )
    forward = flops.forward
    costs = Costs(
        forward=1.0,
        input_grad=flops.input_grad / forward,
        weight_grad=flops.weight_grad / forward,
        recompute=(flops.recompute or forward) / forward,
    )
    return costs, f"measured action FLOPs of the traced ZB-H1 step ({flops.ratio()})"


# ----------------------------------------------------------------------------- the command

CALIBRATION_DEVICES = 8
TOP_TRIES = 4  # compile at most this many times --top plans before giving up on the rest


def describe_accelerator(accelerator: Accelerator) -> str:
    return (
        f"{accelerator.name}: {accelerator.peak_flops / 1e12:g} TFLOP/s bf16, "
        f"{accelerator.memory_gib:g} GiB, {accelerator.ici_gbps:g} GB/s within a slice, "
        f"{accelerator.dcn_gbps:g} GB/s across slices (per device)"
    )


def accelerator_named(
    name: str,
    *,
    peak_tflops: float | None = None,
    ici_gbps: float | None = None,
    dcn_gbps: float | None = None,
) -> Accelerator:
    """The `ACCELERATORS` entry ``name`` (case and spaces ignored), with the overrides."""
    wanted = name.replace(" ", "").lower()
    found = [a for key, a in ACCELERATORS.items() if key.replace(" ", "").lower() == wanted]
    if not found:
        refuse("--accelerator", f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}")
    accelerator = found[0]
    for field, value, scale in (
        ("peak_flops", peak_tflops, 1e12),
        ("ici_gbps", ici_gbps, 1.0),
        ("dcn_gbps", dcn_gbps, 1.0),
    ):
        if value is not None:
            if value <= 0:
                refuse(f"--{field.replace('_', '-')}", f"must be positive, got {value:g}")
            accelerator = dataclasses.replace(accelerator, **{field: value * scale})
    return accelerator


def table_rows(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


PLAN_COLUMNS = [
    "#",
    "mesh",
    "schedule",
    "G",
    "M",
    "B",
    "remat",
    "memory GiB",
    "compiled GiB",
    "step s",
    "compute",
    "comm ICI",
    "comm DCN",
    "bubble",
    "MFU",
]


def plan_row(rank: int, scored: Scored, compiled: int | None) -> list[str]:
    config, t = scored.plan.config, scored.time
    remat = ("stage+" if scored.plan.remat_stages else "") + scored.plan.remat
    return [
        str(rank),
        mesh_label(config.mesh),
        f"{config.pipeline.schedule} R{config.pipeline.repeats}",
        str(config.data.grad_accum),
        str(config.pipeline.microbatches),
        str(config.data.batch_size),
        remat,
        f"{scored.memory / GIB:.1f}",
        "-" if compiled is None else f"{compiled / GIB:.1f}",
        f"{t.total:.3f}",
        f"{t.compute:.3f}",
        f"{t.ici:.3f}",
        f"{t.dcn:.3f}",
        f"{t.bubble:.3f}",
        f"{t.mfu:.1%}",
    ]


def plan_run(
    config: RunConfig,
    *,
    devices: int,
    slices: int,
    accelerator: Accelerator,
    memory_gib: float,
    top: int,
    explain: Mapping[str, int] | None,
    say: Callable[[str], None],
    measure: int = 0,
) -> list[Scored]:
    """Search, print the ranked table with the top plans compiled, and return them (best
    first; those the compiled step confirms). With ``measure``, time the best plan's step
    on this host's devices (`measured_step_seconds`, the median of ``measure`` steps) and
    print it beside the prediction."""
    if measure and devices != jax.device_count():
        refuse(
            "--measure",
            f"times the best plan on this host's devices: plan for the {jax.device_count()} "
            f"it has, not {devices}",
        )
    say(
        f"planning {config.run.name} on {devices} x {describe_accelerator(accelerator)}; "
        f"{memory_gib:g} GiB per device, {slices} slice(s); global batch "
        f"{config.global_batch_size} x {config.data.seq_len} tokens"
    )
    costs, costs_from = measured_costs(config)
    say(f"stage action costs: {costs_from}")
    bar = MeshProgress(say)
    found = search(
        config,
        devices,
        slices,
        accelerator,
        memory_gib,
        costs,
        explain=explain,
        on_mesh=bar.update,
    )
    bar.close()
    by_rules = sum(found.refused.values()) - found.over_memory
    say(
        f"searched {by_rules + found.priced:,} plans: {by_rules:,} refused by the run's rules, "
        f"{found.priced:,} priced, {found.over_memory:,} of them over the memory; the most "
        "common reasons:"
    )
    for reason, count in sorted(found.refused.items(), key=lambda item: -item[1])[:6]:
        say(f"  {count:>9,}  {reason}")
    if explain is not None:
        say(f"--explain {explain}: {len(found.explained)} refused, {len(found.explained_fits)} fit")
        for refusal in found.explained:
            say(f"  refused  {refusal.label}: {refusal.reason}")
        for scored in found.explained_fits[:20]:
            say(
                f"  fits     {scored.plan.label}: {scored.memory / GIB:.1f} GiB, "
                f"{scored.time.total:.3f} s a step"
            )
    if not found.ranked:
        say(f"no plan fits {memory_gib:g} GiB per device")
        return []
    confirmed: list[tuple[Scored, int | None]] = []
    tries = 0
    for scored in found.ranked:
        if len(confirmed) >= top or tries >= top * TOP_TRIES:
            break
        tries += 1
        run_config = scored.plan.run_config()
        started = time.perf_counter()
        compiled = compile_plan(run_config)
        seconds = time.perf_counter() - started
        need = compiled.memory.total if compiled.memory is not None else None
        note = f"compiled {scored.plan.label} in {seconds:.0f} s"
        if need is not None and need > memory_gib * GIB:
            say(f"{note}: {need / GIB:.1f} GiB per device, over the {memory_gib:g} GiB: dropped")
            continue
        if on_cpu() and not compiled.skips_bubbles:
            say(
                f"{note}: XLA:CPU cannot skip its bubbles (collective-permutes in a stage): dropped"
            )
            continue
        say(
            f"{note}: {'-' if need is None else f'{need / GIB:.2f} GiB'} per device "
            f"(predicted {scored.memory / GIB:.2f})"
        )
        confirmed.append((scored, need))
    if top == 0:
        confirmed = [(scored, None) for scored in found.ranked[:10]]
    rows = [PLAN_COLUMNS] + [
        plan_row(rank, scored, need) for rank, (scored, need) in enumerate(confirmed, 1)
    ]
    for line in table_rows(rows):
        say(line)
    if measure and confirmed:
        best = confirmed[0][0]
        seconds = measured_step_seconds(best.plan.run_config(), measure)
        predicted = best.time.total
        say(
            f"measured {best.plan.label} on {devices} x {jax.devices()[0].device_kind}: "
            f"{seconds:.3f} s a step (median of {measure}), predicted {predicted:.3f} s "
            f"(measured / predicted {seconds / predicted:.2f}); MFU "
            f"{best.time.mfu * predicted / seconds:.1%} measured, {best.time.mfu:.1%} predicted"
        )
    return [scored for scored, _ in confirmed]


def on_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


class MeshProgress:
    """The search's progress over meshes: a bar on a terminal, else a line per tenth."""

    def __init__(self, say: Callable[[str], None]):
        import sys

        from eqxzoo.progress import terminal_console

        self.say = say
        self.console = terminal_console(sys.stdout)
        self.progress = None
        self.task = None
        self.shown = -1

    def update(self, done: int, total: int) -> None:
        if self.console is not None:
            from rich.progress import BarColumn, Progress, TextColumn

            if self.progress is None:
                self.progress = Progress(
                    TextColumn("searching meshes"),
                    BarColumn(),
                    TextColumn("{task.completed}/{task.total}"),
                    console=self.console,
                    transient=True,
                )
                self.progress.start()
                self.task = self.progress.add_task("search", total=total)
            self.progress.update(self.task, completed=done)
            return
        tenth = done * 10 // total
        if tenth != self.shown:
            self.shown = tenth
            self.say(f"searching: {done}/{total} meshes")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def calibration_rows(say: Callable[[str], None]) -> list[CalibrationRow]:
    """Compile every `CALIBRATION` config (on `CALIBRATION_DEVICES` devices)."""
    from eqxzoo.run.config import load_config

    rows = []
    for path, overrides in CALIBRATION:
        config = load_config(path, overrides)
        rows.append(calibration_row(config, f"{path.rsplit('/', 1)[-1]}: {plan_of(config).label}"))
        say(f"compiled {rows[-1].label}")
    return rows


def print_calibration(say: Callable[[str], None]) -> None:
    rows = calibration_rows(say)
    fitted = fit_memory_model(rows)
    say(f"fitted MEMORY_MODEL = {fitted!r}")
    held_out = held_out_errors(rows)
    header = ["config", "compiled MiB", "predicted MiB", "error", "with the fit", "error"]
    table = [[*header, "held out"]]
    errors = []
    for row, unseen in zip(rows, held_out, strict=True):
        now = weighed(row.exact, row.terms, MEMORY_MODEL)
        fit = weighed(row.exact, row.terms, fitted)
        errors.append(now / row.compiled - 1)
        table.append(
            [
                row.label,
                f"{row.compiled / 2**20:.1f}",
                f"{now / 2**20:.1f}",
                f"{errors[-1]:+.1%}",
                f"{fit / 2**20:.1f}",
                f"{fit / row.compiled - 1:+.1%}",
                f"{unseen:+.1%}",
            ]
        )
    for line in table_rows(table):
        say(line)

    def within(values: list[float]) -> str:
        return f"{sum(abs(e) < 0.1 for e in values)} of {len(values)}"

    say(
        f"within 10% of the compiled step: {within(errors)} (MEMORY_MODEL), "
        f"{min(errors):+.1%} to {max(errors):+.1%}; held out (each config predicted by the "
        f"model fitted to the others): {within(held_out)}, "
        f"{min(held_out):+.1%} to {max(held_out):+.1%}"
    )
    say(
        "FLOPs per device: predicted (the model's, remat recompute included, attention as its "
        "kernel runs it) and the compiled step's matrix FLOPs, a pipeline's conditionals "
        "counted as often as its schedule runs their branches (`executed_branches`), the "
        "blockwise attention's loops as often as its block plan runs them "
        "(`attention_loop_trips`; a context ring's once). Not like for like with MoE layers: "
        "a dropless MoE on CPU computes every expert's rows."
    )
    flops = [["config", "predicted GFLOP", "compiled GFLOP", "compiled / predicted", "like"]]
    for row in rows:
        like = not row.moe
        flops.append(
            [
                row.label,
                f"{row.flops_predicted / 1e9:.2f}",
                f"{row.flops_compiled / 1e9:.2f}",
                f"{row.flops_compiled / row.flops_predicted:.3f}",
                "yes" if like else "no",
            ]
        )
    for line in table_rows(flops):
        say(line)
    say(
        "Collective bytes per device, predicted / compiled (MiB): the data axes' gathers and "
        "gradient reductions (dp and ep together; the reductions' kinds together, the compiled "
        "ones named: XLA:CPU runs FSDP's reduce-scatters on one stage as all-reduces of the "
        "same buffers), the pipeline's sends, the experts' "
        "exchanges (XLA:CPU runs a 16-bit all-to-all in float32: twice the planner's bytes), "
        "the context ring's shifts (XLA:CPU runs each as an all-to-all of cp slots: cp times "
        "the planner's bytes, up to twice that again in 16 bits)."
    )
    traffic = [
        ["config", "gathers", "reductions", "sends over pp", "all-to-alls over ep", "ring over cp"]
    ]
    for row in rows:
        compiled = data_axes_traffic(row.bytes_compiled)

        def pair(key, compiled=compiled, row=row):
            return (
                f"{row.bytes_predicted.get(key, 0.0) / 2**20:.1f} / "
                f"{compiled.get(key, 0.0) / 2**20:.1f}"
            )

        kinds = ("all-reduce over dp", "reduce-scatter over dp")
        summed = [
            sum(table.get(kind, 0.0) for kind in kinds) / 2**20
            for table in (row.bytes_predicted, compiled)
        ]
        compiled_kinds = [kind.split()[0] for kind in kinds if compiled.get(kind)]
        traffic.append(
            [
                row.label,
                pair("all-gather over dp"),
                f"{summed[0]:.1f} / {summed[1]:.1f} ({', '.join(compiled_kinds) or 'none'})",
                pair("collective-permute over pp"),
                pair("all-to-all over ep"),
                f"{row.bytes_predicted.get('collective-permute over cp', 0.0) / 2**20:.1f} / "
                f"{compiled.get('all-to-all over cp', 0.0) / 2**20:.1f}",
            ]
        )
    for line in table_rows(traffic):
        say(line)
