"""Pipelined training equals single-device training (fp32, rtol 1e-5), on many meshes.

One grid covers every family with the split backward (ZB-H1's and ZB-V's B and W, which cut
the pullback of the family's layers in two: `BackwardSplit`) and on each of the dp, tp and ep
axes; each of the three ways a stage's backward runs (autodiff of GPipe's and circular's
forward table, the 1F1B executor's fused BW, its split B and W: `EXECUTORS`) on every mesh;
and each kind of family (dense, MoE, with a dense prefix as DeepSeek's) with every schedule,
cut into 1, 2, 4 and 8 stages, with each microbatch count (M = P, M = 2P + 1 not a multiple of P,
M = 4P) and each variant of the stage (no stage rematerialisation, the blockwise attention
kernel, the chunked loss with the z-loss and the load-balance loss pooled over layers,
stages computing through their bubbles). Every schedule, microbatch count and variant also
meets each of the dp, tp and ep axes and each stage count (`with_axes_and_stages`), and the
microbatch counts and variants every schedule: each of those pairs appears together at
least once (`grids.covering`, cheap cases first: `case_cost`), in 37 cases instead of the
product's 9,225 (``EQXZOO_FULL_GRIDS=1`` runs the product).
Every case fills the pipeline's bubbles (its idle ticks' inputs, and what idle stages send)
with NaN: they must leak into nothing. Every case masks a quarter of the targets (a loss mask,
`with_masked_targets`): the loss is the sum over the rest divided by their number. Every other
case of the grid (and every context-parallel one) packs documents into its sequences
(`with_documents`): attention stays within each, positions restart at each.

A family meets the pipeline through its layers: the mesh axes that split their arrays, and
the split backward, which cuts their pullback where the family's own residuals fall. The
autodiff and fused executors differentiate a stage whole (`jax.vjp` of its layers, as one
device does), so a family meets them through its kind, as it meets the schedules: pairing
every family with each executor as well took 46 cases (about 300 worker-seconds more).
Stage counts, microbatch counts and the variants are the pipeline's side, and a family
meets them through its kind: what the stage carries (router statistics, balancing biases,
a prefix before the stages). Each family's layers against the dense kernel, and the
chunked loss with soft-capped logits, are compared directly (`test_kernels.py`,
`test_cross_entropy.py`). Pairing every family with every stage count, microbatch count and
variant as well took 78 cases (a third of the suite's time) for pairs whose code does not
depend on the family.
"""

import dataclasses
import functools
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grids import case_id, cover, covering, full_grids_only, levels_of, pairs_of

import models
from eqxzoo.nn import documents_of
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.parallel.mesh import DcnConfig
from eqxzoo.parallel.schedule import ScheduleError
from eqxzoo.train.layout import from_pipeline_layout, to_pipeline_layout
from eqxzoo.train.loss import (
    IGNORED,
    batch_documents,
    pipelined_loss,
    pipelined_loss_and_grad,
    sequential_loss,
)
from eqxzoo.train.loss_terms import LossConfig
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import split_trainable
from eqxzoo.train.step import step_gradients
from eqxzoo.typed_config import ConfigError

N_LAYERS = 8
BATCH, SEQ = 4, 8

REPEATS = {"gpipe": 1, "circular": 2, "1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zb_v": 2}
# In the order the grid prefers them; one stage (pp = 1) is only GPipe's.
MESHES = {
    "dp2,pp2,tp2": MeshConfig(dp=2, pp=2, tp=2),
    "dp2,pp2,ep2": MeshConfig(dp=2, pp=2, ep=2),
    "pp2,tp2,ep2": MeshConfig(pp=2, tp=2, ep=2),
    "pp4,tp2": MeshConfig(pp=4, tp=2),
    "dp2,pp4": MeshConfig(dp=2, pp=4),
    "pp4,ep2": MeshConfig(pp=4, ep=2),
    "pp8": MeshConfig(pp=8),
    "pp2": MeshConfig(pp=2),
    "dp2,tp2": MeshConfig(dp=2, tp=2),
    "dp2,tp2,ep2": MeshConfig(dp=2, tp=2, ep=2),
}
# Meshes across slices (`test_slices_of_a_hybrid_mesh_run_the_same_step`), outside the grid.
HYBRID_MESHES = {
    "dp4,pp2/dcn.dp2": MeshConfig(dp=4, pp=2, dcn=DcnConfig(dp=2)),
    "dp2,pp2,tp2/dcn.dp2": MeshConfig(dp=2, pp=2, tp=2, dcn=DcnConfig(dp=2)),
    "dp4,tp2/dcn.dp2": MeshConfig(dp=4, tp=2, dcn=DcnConfig(dp=2)),
    "dp2,pp2,ep2/dcn.dp2": MeshConfig(dp=2, pp=2, ep=2, dcn=DcnConfig(dp=2)),
}
# Meshes that split each sequence over cp (`test_context_parallel_training_equals_one_device`).
CONTEXT_MESHES = {
    "dp2,pp2,cp2": MeshConfig(dp=2, pp=2, cp=2),
    "pp2,cp2,tp2": MeshConfig(pp=2, cp=2, tp=2),
    "cp4,tp2": MeshConfig(cp=4, tp=2),
    "dp4,cp2": MeshConfig(dp=4, cp=2),
    "pp2,cp4": MeshConfig(pp=2, cp=4),
    "pp2,cp2,ep2": MeshConfig(pp=2, cp=2, ep=2),
}
# Meshes of 4 and 8 expert devices (`test_expert_parallel_training_equals_one_device`).
EXPERT_MESHES = {
    "ep8": MeshConfig(ep=8),
    "dp2,ep4": MeshConfig(dp=2, ep=4),
    "pp2,ep4": MeshConfig(pp=2, ep=4),
}
MICROBATCHES = {"M=2P+1": lambda P: 2 * P + 1, "M=P": lambda P: P, "M=4P": lambda P: 4 * P}
# What a case changes in the stage: its StepConfig and model config fields.
VARIANTS = {
    "plain": ({}, {}),
    "no-remat": ({"remat_stages": False}, {}),
    "blockwise": ({}, {"attention_kernel": "blockwise", "attention_block_size": 3}),
    "chunked-z-pooled": (
        {"loss": {"chunk_size": 16, "z_loss_weight": 0.01, "load_balance_pooling": "microbatch"}},
        {"vocab_size": 64},
    ),
    "compute-bubbles": ({"skip_bubbles": False}, {}),
}
# Variants outside the grid: each layer rematerialised but for its matmuls' outputs (as
# `configs/llama3_1b.toml` runs), whose split backward replays a cp shard's positions.
MORE_VARIANTS = {"remat-dots": ({}, {"remat": "dots"})}
FAMILIES = list(models.families())
# How each schedule's backward runs (`eqxzoo.parallel.pipeline_grad`): what a family's layers
# meet.
EXECUTORS = {
    "gpipe": "autodiff",
    "circular": "autodiff",
    "1f1b": "fused",
    "interleaved_1f1b": "fused",
    "zb_h1": "split",
    "zb_v": "split",
}


@functools.cache
def kind_of_family(family: str) -> str:
    config = models.registry.tiny_config(family, n_layers=N_LAYERS)
    if config.first_dense_layers:
        return "dense-prefix"
    return "dense" if config.moe is None else "moe"


def family_meets_schedule(case: dict) -> list[tuple]:
    """(kind of family, executor), (kind of family, schedule), and the family where the
    schedule splits its backward."""
    kind, executor = kind_of_family(case["family"]), EXECUTORS[case["schedule"]]
    keys = [("executor", kind, executor), ("kind", kind, case["schedule"])]
    return keys + [("split", case["family"])] if executor == "split" else keys


# What a case costs to check, relative: its compile time goes with the kind of family and the
# stage's variant, hardly with the schedule's length (fitted to the suite's durations at
# 93cd248: a dense plain case about 9 s).
KIND_COST = {"dense": 1.0, "moe": 1.9, "dense-prefix": 3.1}
VARIANT_COST = {
    "plain": 1.0,
    "no-remat": 1.1,
    "blockwise": 2.1,
    "chunked-z-pooled": 1.2,
    "compute-bubbles": 1.0,
}


def case_cost(case: dict) -> float:
    return KIND_COST[kind_of_family(case["family"])] * VARIANT_COST[case["variant"]]


def mesh_of(case: dict) -> MeshConfig:
    return (MESHES | HYBRID_MESHES | CONTEXT_MESHES | EXPERT_MESHES)[case["mesh"]]


def schedule_of(case: dict) -> Schedule:
    stages = mesh_of(case).pp
    return schedule_named(case["schedule"], stages, case["microbatches"])


@functools.cache
def schedule_named(name: str, stages: int, microbatches: str) -> Schedule:
    """One `Schedule` for each of the grid's 13,500 product cases that share it: building one
    checks its fields (a millisecond under the jaxtyping hook), once per collecting worker."""
    return Schedule(name, stages, MICROBATCHES[microbatches](stages), REPEATS[name])


def runs(case: dict) -> bool:
    """Whether the case is a valid run: its schedule exists, its layers split into the stages'
    chunks, one stage runs GPipe (the other schedules are GPipe there), and only a forward
    schedule computes through its bubbles (XLA:CPU's fallback)."""
    try:
        schedule = schedule_of(case)
    except ScheduleError:
        return False
    return (
        N_LAYERS % (schedule.stages * schedule.repeats) == 0
        and (schedule.stages > 1 or schedule.name == "gpipe")
        and (case["variant"] != "compute-bubbles" or not schedule.fuses_backward)
    )


def split_axes(mesh: MeshConfig) -> list[str]:
    """Which of dp, tp and ep ``mesh`` splits."""
    return [axis for axis in ("dp", "tp", "ep") if getattr(mesh, axis) > 1]


def how_the_mesh_splits_the_family(case: dict) -> list[tuple]:
    """(family, axis) for each of dp, tp and ep that the case's mesh splits (its arrays split
    along those axes), and (kind of family, stages): its layers cut into that many stages."""
    mesh = MESHES[case["mesh"]]
    axes = [("axis", case["family"], axis) for axis in split_axes(mesh)]
    return [*axes, ("stages", kind_of_family(case["family"]), mesh.pp)]


def kind_meets(name: str):
    """The requirement that each kind of family meets every level of ``name``."""
    return lambda case: [(name, kind_of_family(case["family"]), case[name])]


def with_axes_and_stages(name: str):
    """The requirement that each level of ``name`` meets each of the dp, tp and ep axes (a
    mesh that splits it) and each stage count."""

    def keys(case: dict) -> list[tuple]:
        mesh = MESHES[case["mesh"]]
        return [(name, "axis", axis, case[name]) for axis in split_axes(mesh)] + [
            (name, "stages", mesh.pp, case[name])
        ]

    return keys


def executor_meets_mesh(case: dict) -> list[tuple]:
    return [("executor-mesh", EXECUTORS[case["schedule"]], case["mesh"])]


FACTORS = {
    "family": FAMILIES,
    "schedule": list(REPEATS),
    "mesh": list(MESHES),
    "microbatches": list(MICROBATCHES),
    "variant": list(VARIANTS),
}
GRID = covering(
    FACTORS,
    [
        family_meets_schedule,
        executor_meets_mesh,
        with_axes_and_stages("schedule"),
        how_the_mesh_splits_the_family,
        kind_meets("microbatches"),
        pairs_of("schedule", "microbatches"),
        with_axes_and_stages("microbatches"),
        kind_meets("variant"),
        pairs_of("schedule", "variant"),
        with_axes_and_stages("variant"),
    ],
    runs,
    cost=case_cost,
)
# The fast part (``-m "not slow"``): each schedule, mesh, microbatch count and variant at
# least once (on the cheapest families: the grid lists the bare decoder first).
QUICK = cover(GRID, levels_of("schedule", "mesh", "microbatches", "variant"), case_cost)
CASES = [
    pytest.param(case, id=case_id(case), marks=() if case in QUICK else pytest.mark.slow)
    for case in GRID
]


def without_padding(aux: dict) -> dict:
    """``aux`` without what describes how the experts ran rather than what the model
    computes: the dropless path's padding, the experts' devices' load."""
    return {
        name: value
        for name, value in aux.items()
        if name not in ("padding_fraction", "device_load")
    }


def with_masked_targets(data: dict) -> dict:
    """``data`` with each sequence's first two targets (a prompt's) and a fixed random fifth
    of the rest `IGNORED`."""
    targets = np.asarray(data["targets"]).copy()
    masked = np.random.default_rng(0).random(targets.shape) < 0.2
    masked[..., :2] = True
    targets[masked] = IGNORED
    return {**data, "targets": jnp.asarray(targets)}


def with_documents(data: dict) -> dict:
    """``data`` with its sequences cut into packed documents at fixed random places (about
    one token in three starts one): their ``segments`` and ``positions`` (`documents_of`)."""
    starts = np.random.default_rng(1).random(data["tokens"].shape) < 0.35
    starts[..., 0] = True
    documents = documents_of(jnp.asarray(np.cumsum(starts, axis=-1) - 1))
    return {**data, "segments": documents.segments, "positions": documents.positions}


def packs_documents(case: dict, mesh: MeshConfig) -> bool:
    """Whether the case packs documents: every other case of the grid, every cp case."""
    return mesh.cp > 1 or (case in GRID and GRID.index(case) % 2 == 1)


def assert_equals_one_device(results, assert_trees_close) -> None:
    """The pipelined loss, aux values and gradients of `loss_and_grads` equal one device's
    (fp32, rtol 1e-5)."""
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = results
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    assert_trees_close(pp_aux, aux)
    assert_trees_close(pp_grads, grads)


def loss_and_grads(
    tiny_config,
    random_batch,
    case: dict,
    context_parallel: str = "ring",
    lora=None,
    n_experts: int | None = None,
):
    """``(sequential (loss, aux), grads), (pipelined (loss, aux), grads)`` of the case's tiny
    model (with ``lora``'s adapters, `models.LoraConfig`, if given: ``lora_b`` drawn
    non-zero, as trained adapters are), the pipelined one with
    NaN bubbles (and, on a mesh with cp, its layers splitting each sequence over cp by
    ``context_parallel``, as a run builds them).

    The aux values leave out ``padding_fraction``: it describes how the dropless path ran
    (the sequential reference routes each sequence alone, a pipeline stage its whole
    microbatch at once), not what the model computes."""
    schedule = schedule_of(case)
    step_fields, model_fields = (VARIANTS | MORE_VARIANTS)[case["variant"]]
    step_fields = dict(step_fields)
    loss = LossConfig(load_balance_weight=0.1, router_z_weight=0.01, **step_fields.pop("loss", {}))
    mesh_config = mesh_of(case)
    config = StepConfig(
        schedule=schedule, loss=loss, mesh_axes=mesh_config.axis_names, **step_fields
    )
    pipelined_config = dataclasses.replace(config, bubble_fill=jnp.nan)
    mesh = make_mesh(mesh_config, jax.devices()[: mesh_config.size])
    model_config = tiny_config(case["family"], n_layers=N_LAYERS)
    model_config = dataclasses.replace(model_config, **model_fields, lora=lora)
    if n_experts is not None:
        moe = dataclasses.replace(model_config.moe, n_experts=n_experts)
        model_config = dataclasses.replace(model_config, moe=moe)

    def build(config):
        model = models.DecoderLM(config, key=jax.random.key(0))
        if lora is None:
            return model
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: (
                leaf + 0.02 * jax.random.normal(jax.random.key(3), leaf.shape)
                if jax.tree_util.keystr(path).endswith(".lora_b")
                else leaf
            ),
            model,
        )

    model = build(model_config)
    # The same parameters, as a run builds the layers: attending across the shards of each
    # sequence over cp, exchanging tokens with the experts' devices over ep.
    split_fields = {}
    if mesh_config.cp > 1:
        split_fields |= {"context_axis": "cp", "context_parallel": context_parallel}
    if mesh_config.ep > 1 and model_config.moe is not None:
        split_fields["expert_axis"] = "ep"
    split_model = (
        build(dataclasses.replace(model_config, **split_fields)) if split_fields else model
    )
    batch = max(BATCH, mesh_config.dp * mesh_config.ep)  # each sequence on one device
    data = with_masked_targets(random_batch((schedule.microbatches, batch, SEQ)))
    if packs_documents(case, mesh_config):
        data = with_documents(data)
    documents = batch_documents(data)
    if case["variant"] == "chunked-z-pooled":  # the plain loss of the whole logits as the reference
        config = dataclasses.replace(config, loss=dataclasses.replace(loss, chunk_size=0))

    def sequential(model):
        return sequential_loss(
            model, data["tokens"], data["targets"], config=config, documents=documents
        )

    def pipelined(model):
        return pipelined_loss(
            model,
            data["tokens"],
            data["targets"],
            config=pipelined_config,
            mesh=mesh,
            documents=documents,
        )

    def fused(model):
        return pipelined_loss_and_grad(
            model,
            data["tokens"],
            data["targets"],
            config=pipelined_config,
            mesh=mesh,
            documents=documents,
        )

    value_and_grad = functools.partial(eqx.filter_value_and_grad, has_aux=True)
    (expected_loss, expected_aux), expected_grads = eqx.filter_jit(value_and_grad(sequential))(
        model
    )
    staged = to_pipeline_layout(split_model, schedule)
    pipelined_value_and_grad = fused if schedule.fuses_backward else value_and_grad(pipelined)
    if pipelined_config.slice_axes:  # the step's way: each slice on its own (`per_slice`)
        pipelined_value_and_grad = one_step_gradients(pipelined_config, mesh, data)
    (loss, aux), grads = eqx.filter_jit(pipelined_value_and_grad)(staged)
    return (
        ((expected_loss, without_padding(expected_aux)), expected_grads),
        ((loss, without_padding(aux)), from_pipeline_layout(grads, schedule)),
    )


def one_step_gradients(config: StepConfig, mesh, data):
    """``model -> ((loss, aux), grads)`` through the train step's `step_gradients` of one
    accumulation step of ``data``, split as the trainer splits it (`split_trainable`); the
    gradients of what it does not train (the balancing biases) as zeros; without the batch's
    target count, which the step also reports (`test_train_step.py` checks it)."""

    def value_and_grad(model):
        trainable, frozen = split_trainable(model, config.optimizer)
        batch = jax.tree.map(lambda x: x[None], data)
        grads, metrics = step_gradients(config, mesh)(trainable, frozen, batch)
        for counted in ("target_tokens", "masked_fraction"):
            metrics.pop(counted)
        untrained = jax.tree.map(jnp.zeros_like, eqx.filter(frozen, eqx.is_inexact_array))
        return (metrics.pop("loss"), metrics), eqx.combine(grads, untrained)

    return value_and_grad


@pytest.mark.parametrize("case", CASES)
def test_pipelined_loss_and_gradients_equal_sequential(
    case, tiny_config, random_batch, assert_trees_close
):
    ((loss, aux), grads), ((pp_loss, pp_aux), pp_grads) = loss_and_grads(
        tiny_config, random_batch, case
    )
    assert np.isfinite(float(pp_loss))
    np.testing.assert_allclose(pp_loss, loss, rtol=1e-5)
    assert_trees_close(pp_aux, aux)
    if case["family"] == "gpt2":
        grads, pp_grads = (without_key_bias_gradient(g) for g in (grads, pp_grads))
    assert_trees_close(pp_grads, grads)
    if case["variant"] == "chunked-z-pooled":
        assert aux["z_loss"] > 1.0  # the log-sum-exp of 64 logits near zero is ~log(64)
    weighted = {"z_loss": 0.01, "load_balance_loss": 0.1, "router_z_loss": 0.01}
    parts = [aux["cross_entropy"]] + [w * aux[name] for name, w in weighted.items() if name in aux]
    np.testing.assert_allclose(loss, sum(parts), rtol=1e-6)
    if "expert_fraction" in aux:  # per layer and expert, whatever the stage layout
        model_config = tiny_config(case["family"], n_layers=N_LAYERS)
        assert pp_aux["expert_fraction"].shape == (N_LAYERS, model_config.moe.n_experts)
    window = getattr(pp_grads.blocks.layers.attention, "window", None)
    assert window is None, "per-layer data is staged with its layers and never trained"


HYBRID_CASES = [
    dict(zip(FACTORS, case, strict=True))
    for case in (
        ("llama", "circular", "dp4,pp2/dcn.dp2", "M=2P+1", "plain"),
        ("qwen_moe", "zb_h1", "dp2,pp2,tp2/dcn.dp2", "M=P", "plain"),
        ("deepseek_v3", "1f1b", "dp4,pp2/dcn.dp2", "M=P", "plain"),
        ("mixtral", "gpipe", "dp4,tp2/dcn.dp2", "M=2P+1", "chunked-z-pooled"),
        ("olmoe", "1f1b", "dp2,pp2,ep2/dcn.dp2", "M=P", "plain"),
    )
]


@pytest.mark.parametrize("case", HYBRID_CASES, ids=case_id)
def test_slices_of_a_hybrid_mesh_run_the_same_step(
    case, tiny_config, random_batch, assert_trees_close
):
    """Where dp spans slices the step's gradients are each slice's own, averaged once
    (`step_gradients`: a region manual over dp_dcn): the same loss, aux values and gradients
    as one device (fp32, 1e-5), dense, MoE (split backward; one stage with the load-balance
    loss pooled over the microbatch), a dense prefix (fused backward). (pp across slices
    changes only which devices hold the stages: `test_launch.py` resumes a run on it.)"""
    assert_equals_one_device(
        loss_and_grads(tiny_config, random_batch, case),
        assert_trees_close,
    )


CONTEXT_CASES = [
    (dict(zip(FACTORS, case, strict=True)), strategy)
    for *case, strategy in (
        ("llama", "zb_v", "dp2,pp2,cp2", "M=2P+1", "remat-dots", "ring"),
        ("mixtral", "1f1b", "pp2,cp2,tp2", "M=P", "plain", "ring"),
        ("gemma2", "1f1b", "dp2,pp2,cp2", "M=P", "blockwise", "all_gather"),
        ("deepseek_v3", "circular", "pp2,cp4", "M=P", "plain", "all_gather"),
        ("mixtral", "gpipe", "cp4,tp2", "M=P", "chunked-z-pooled", "ring"),
        ("llama", "gpipe", "dp4,cp2", "M=2P+1", "plain", "ring"),
        ("qwen3_moe", "zb_h1", "pp2,cp2,ep2", "M=2P+1", "plain", "ring"),
        ("gpt_oss", "interleaved_1f1b", "pp2,cp4", "M=P", "no-remat", "ring"),
    )
]
# The fused executor with cp (gemma2's case) and tp with cp (mixtral's cp4 x tp2), dp with cp
# (llama's and gemma2's region cases): these two repeat them, one switch away.
REPEATED_CONTEXT_CASES = ("mixtral-1f1b-pp2,cp2,tp2-M=P-plain", "llama-gpipe-dp4,cp2-M=2P+1-plain")


@pytest.mark.parametrize(
    ("case", "strategy"),
    [
        (full_grids_only if case_id(case) in REPEATED_CONTEXT_CASES else pytest.param)(
            case, strategy, id=f"{case_id(case)}-{strategy}"
        )
        for case, strategy in CONTEXT_CASES
    ],
)
def test_context_parallel_training_equals_one_device(
    case, strategy, tiny_config, random_batch, assert_trees_close
):
    """Each sequence split over cp (balanced head-tail shards; ring or all-gather attention)
    inside the pipeline, with dp, tp, ep, the autodiff, fused and split executors and a
    dense prefix: the loss, every aux value and every gradient of one device (fp32, 1e-5).
    Dense (its layers rematerialised but for the matmuls' outputs, under ZB-V), MoE (router
    statistics averaged over the shards), windowed and soft-capped (Gemma 2), latent
    attention (DeepSeek-V3), sinks and windows (GPT-OSS)."""
    assert_equals_one_device(
        loss_and_grads(tiny_config, random_batch, case, context_parallel=strategy),
        assert_trees_close,
    )


EXPERT_CASES = [
    dict(zip(FACTORS, case, strict=True))
    for case in (
        ("mixtral", "gpipe", "ep8", "M=P", "plain"),
        ("deepseek_v3", "1f1b", "pp2,ep4", "M=P", "plain"),
        ("qwen_moe", "zb_h1", "pp2,ep4", "M=2P+1", "no-remat"),
        ("gpt_oss", "gpipe", "dp2,ep4", "M=2P+1", "chunked-z-pooled"),
    )
]


@pytest.mark.parametrize("case", EXPERT_CASES, ids=case_id)
def test_expert_parallel_training_equals_one_device(
    case, tiny_config, random_batch, assert_trees_close
):
    """Experts split over 4 and 8 devices, each holding its own sequences and exchanging
    their tokens with the experts' devices by all-to-all (the grid's MESHES cover ep 2 with
    every schedule, dp and tp): the loss, every aux value (the expert loads included) and
    every gradient of one device (fp32, 1e-5), with the autodiff, fused and split executors,
    a dense prefix (DeepSeek-V3) and the chunked loss with the load-balance loss pooled over
    the microbatch. 8 experts: one per device on
    ep8, two on ep4."""
    assert_equals_one_device(
        loss_and_grads(tiny_config, random_batch, case, n_experts=8),
        assert_trees_close,
    )


ONE_STAGE_CASES = [
    dict(zip(FACTORS, case, strict=True))
    for case in (
        ("llama", "zb_h1", "dp2,tp2", "M=2P+1", "chunked-z-pooled"),
        ("gemma2", "1f1b", "dp2,tp2", "M=P", "plain"),
        ("mixtral", "1f1b", "dp2,tp2,ep2", "M=2P+1", "chunked-z-pooled"),
    )
]


@pytest.mark.parametrize("case", ONE_STAGE_CASES, ids=case_id)
def test_the_fused_executors_on_one_stage_equal_one_device(
    case, tiny_config, random_batch, assert_trees_close
):
    """The 1F1B family's executors on one stage (the grid runs GPipe there; a run and the
    planner accept them): dense, with no region (its chunked loss the partitioner's over
    the batch's split, `eqxzoo.train.loss.gathered_columns`), and MoE, in a region manual
    over dp and ep: the loss, aux values and gradients of one device (fp32, 1e-5). Without
    a region nothing varies over a manual axis, and the executor took every cotangent for
    a constant's: every layer's gradient was zero."""
    assert_equals_one_device(loss_and_grads(tiny_config, random_batch, case), assert_trees_close)


def test_a_pooled_load_balance_loss_is_refused_where_a_split_backward_meets_slices():
    mesh_axes = HYBRID_MESHES["dp2,pp2,tp2/dcn.dp2"].axis_names
    pooled = LossConfig(load_balance_pooling="microbatch")
    with pytest.raises(ConfigError, match=r"^loss\.load_balance_pooling: \"microbatch\" pools"):
        StepConfig(schedule=Schedule("zb_h1", 2, 2, 1), loss=pooled, mesh_axes=mesh_axes)
    StepConfig(schedule=Schedule("circular", 2, 2, 2), loss=pooled, mesh_axes=mesh_axes)
    StepConfig(schedule=Schedule("zb_h1", 2, 2, 1), loss=pooled)


def without_key_bias_gradient(grads):
    """``grads`` with the key bias's gradient checked to be zero and removed.

    Without rotary embeddings (GPT-2) the key bias adds the same ``q . b_k`` to every score of
    a query, which the softmax ignores: its gradient is zero in exact arithmetic and rounding
    noise (~1e-12) in floats, which no relative tolerance can compare.
    """
    attention = grads.blocks.layers.attention
    scale = np.max(np.abs(np.asarray(attention.wk)))
    assert np.max(np.abs(np.asarray(attention.bk))) < 1e-6 * scale
    return eqx.tree_at(lambda g: g.blocks.layers.attention.bk, grads, None)


def test_the_grid_covers_every_pair():
    """The pairs the module docstring promises, checked on the grid itself."""

    def seen(*names):
        return {tuple(case[name] for name in names) for case in GRID}

    split = {case["family"] for case in GRID if EXECUTORS[case["schedule"]] == "split"}
    assert split == set(FAMILIES)
    kinds = {(kind_of_family(case["family"]), case["schedule"]) for case in GRID}
    assert kinds == {(k, s) for k in ("dense", "moe", "dense-prefix") for s in REPEATS}

    def runnable(**levels) -> bool:
        """Whether some case of the dense family with these levels runs."""
        free = {name: values for name, values in FACTORS.items() if name not in levels}
        free["family"] = ["llama"]
        return any(
            runs(dict(zip(free, rest, strict=True)) | levels)
            for rest in itertools.product(*free.values())
        )

    for name in ("schedule", "microbatches", "variant"):
        met = {key for case in GRID for key in with_axes_and_stages(name)(case)}
        assert met == {
            (name, "axis", axis, level)
            for axis in ("dp", "tp", "ep")
            for level in FACTORS[name]
            if any(
                runnable(mesh=mesh, **{name: level})
                for mesh in MESHES
                if getattr(MESHES[mesh], axis) > 1
            )
        } | {
            (name, "stages", stages, level)
            for stages in (1, 2, 4, 8)
            for level in FACTORS[name]
            if any(
                runnable(mesh=mesh, **{name: level}) for mesh in MESHES if MESHES[mesh].pp == stages
            )
        }, name
    executors_on_meshes = {(EXECUTORS[s], m) for s, m in seen("schedule", "mesh")}
    assert executors_on_meshes == {
        (executor, mesh)
        for executor in set(EXECUTORS.values())
        for mesh in MESHES
        if MESHES[mesh].pp > 1 or executor == "autodiff"
    }
    for name in ("schedule", "family", "mesh"):
        assert {level for (level,) in seen(name)} == set(
            FAMILIES if name == "family" else REPEATS if name == "schedule" else MESHES
        )
    splits = {key for case in GRID for key in how_the_mesh_splits_the_family(case)}
    kinds = ("dense", "moe", "dense-prefix")
    assert splits == {("axis", f, a) for f in FAMILIES for a in ("dp", "tp", "ep")} | {
        ("stages", k, P) for k in kinds for P in (1, 2, 4, 8)
    }
    for name, levels in (("variant", VARIANTS), ("microbatches", MICROBATCHES)):
        met = {(kind_of_family(case["family"]), case[name]) for case in GRID}
        assert met == {(k, level) for k in kinds for level in levels}
    assert len(GRID) < 38
