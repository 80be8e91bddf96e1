"""The train step on meshes: optimizer steps, global clipping, replicas, frozen parameters."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
from eqxzoo.errors import ConfigError
from eqxzoo.nn import (
    MLP,
    Embedding,
    HeadInputs,
    LanguageModel,
    Linear,
    RMSNorm,
    Stack,
    make_layers_for_keys,
)
from eqxzoo.optim import OptimizerConfig, build_optimizer, decay_mask
from eqxzoo.parallel import (
    MeshConfig,
    MeshError,
    Schedule,
    ScheduleError,
    check_model_fits,
    make_mesh,
)
from eqxzoo.train.layout import (
    checkpoint_layout,
    from_checkpoint_layout,
    from_pipeline_layout,
    to_pipeline_layout,
)
from eqxzoo.train.loss import IGNORED, sequential_loss
from eqxzoo.train.loss_terms import LossConfig
from eqxzoo.train.settings import Precision, StepConfig
from eqxzoo.train.state import (
    abstract_train_state,
    init_train_state,
    init_train_state_from,
    split_trainable,
    train_state_axes,
)
from eqxzoo.train.step import (
    accumulated_gradients,
    compile_train_step,
    make_train_step,
    step_gradients,
    train_step,
)

N_LAYERS = 4
SHAPE = (2, 4, 4, 8)  # (G, M, B, T)


def step_config(stages, optimizer, repeats=1):
    schedule = Schedule("circular" if repeats > 1 else "gpipe", stages, SHAPE[1], repeats)
    return StepConfig(schedule=schedule, optimizer=optimizer)


@pytest.fixture
def dense(tiny_config):
    return tiny_config("llama", n_layers=N_LAYERS)


@pytest.fixture
def moe(tiny_config):
    return tiny_config("mixtral", n_layers=N_LAYERS)


@pytest.fixture
def make_batch(random_batch):
    return lambda seed=0: random_batch(SHAPE, seed)


@pytest.fixture
def run_steps(make_batch):
    """``run_steps(make_model, mesh_config, stages, optimizer, n_steps, repeats=1)``: the
    final state and each step's metrics; ``make_model`` is a model config or a factory."""

    def run(make_model, mesh_config, stages, optimizer, n_steps, repeats=1):
        if isinstance(make_model, models.DecoderConfig):
            make_model = functools.partial(models.DecoderLM, make_model)
        mesh = make_mesh(mesh_config, jax.devices()[: mesh_config.size])
        config = step_config(stages, optimizer, repeats)
        state = init_train_state(make_model, jax.random.key(0), config=config, mesh=mesh)
        step = make_train_step(config, mesh)
        history = []
        for index in range(n_steps):
            state, metrics = step(state, make_batch(index))
            history.append(jax.device_get(metrics))
        return state, history

    return run


def host(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


# Adam divides by sqrt(v) + eps: with a tiny eps, gradients that are zero up to fp32 rounding
# (reduction order differs between meshes) would turn into full-size, sign-random updates.
ADAM = OptimizerConfig(
    learning_rate=1e-2, warmup_steps=1, decay_steps=10, eps=1e-3, weight_decay=0.1
)


@pytest.mark.parametrize(
    ("family", "mesh_config", "repeats"),
    [("llama", MeshConfig(dp=2, pp=2, tp=2), 1), ("mixtral", MeshConfig(dp=2, pp=2, ep=2), 2)],
    ids=["dense-gpipe", "moe-circular"],
)
def test_three_steps_on_a_mesh_equal_one_device(
    family, mesh_config, repeats, tiny_config, run_steps, assert_trees_close
):
    model_config = tiny_config(family, n_layers=N_LAYERS)
    one_state, one_history = run_steps(model_config, MeshConfig(), 1, ADAM, 3)
    mesh_state, mesh_history = run_steps(model_config, mesh_config, 2, ADAM, 3, repeats)
    for one, many in zip(one_history, mesh_history, strict=True):
        np.testing.assert_allclose(many["loss"], one["loss"], rtol=1e-5)
        np.testing.assert_allclose(many["grad_norm"], one["grad_norm"], rtol=1e-5)
    assert_trees_close(
        from_pipeline_layout(mesh_state.model, step_config(2, ADAM, repeats).schedule),
        from_pipeline_layout(one_state.model, step_config(1, ADAM).schedule),
    )
    assert one_history[2]["loss"] < one_history[0]["loss"] + 1.0


def test_metrics_of_a_moe_step(moe, run_steps):
    _, (metrics,) = run_steps(moe, MeshConfig(pp=2, ep=2), 2, ADAM, 1)
    for name in (
        "loss",
        "cross_entropy",
        "load_balance_loss",
        "router_z_loss",
        "dropped_fraction",
        "padding_fraction",
        "grad_norm",
        "learning_rate",
    ):
        assert np.shape(metrics[name]) == (), name
    assert 0.0 < float(metrics["padding_fraction"]) < 1.0
    assert metrics["expert_fraction"].shape == (4, 4)
    np.testing.assert_allclose(metrics["expert_fraction"].sum(-1), np.ones(4), rtol=1e-5)
    assert int(metrics["tokens"]) == np.prod(SHAPE)
    assert float(metrics["learning_rate"]) == 0.0  # warmup starts at zero


def test_clipping_uses_the_global_norm(dense, run_steps, make_batch, assert_trees_close):
    """With eps = 1 Adam's first update is ~ linear in the gradient, so the clip scale shows.

    The pipelined step on dp x pp x tp must equal optax applied on one device to the
    sequentially computed gradient, clipped by its true global norm.
    """
    optimizer = dataclasses.replace(ADAM, eps=1.0, clip_norm=1e-3, weight_decay=0.0)
    mesh_state, (metrics,) = run_steps(dense, MeshConfig(dp=2, pp=2, tp=2), 2, optimizer, 1)

    model = models.DecoderLM(dense, key=jax.random.key(0))
    config = step_config(1, optimizer)
    batch = make_batch(0)

    def loss(model):
        losses = [
            sequential_loss(model, batch["tokens"][g], batch["targets"][g], config=config)[0]
            for g in range(SHAPE[0])
        ]
        return sum(losses) / len(losses)

    grads = eqx.filter_grad(loss)(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    tx = build_optimizer(optimizer)
    opt_state = tx.init(params)
    tx.update(grads, opt_state, params)  # step 0 has learning rate 0: advance once
    _, opt_state = tx.update(grads, opt_state, params)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-5)
    assert float(optax.tree.norm(grads)) > 100 * optimizer.clip_norm

    # Both sides take their first optimizer step at learning rate 0; compare the second.
    mesh_state, _ = (
        make_train_step(step_config(2, optimizer), make_mesh(MeshConfig(dp=2, pp=2, tp=2)))(
            mesh_state, batch
        ),
        None,
    )
    mesh_state = mesh_state[0]
    updates, _ = tx.update(grads, opt_state, params)
    expected = optax.apply_updates(params, updates)
    actual = eqx.filter(
        from_pipeline_layout(mesh_state.model, step_config(2, optimizer).schedule),
        eqx.is_inexact_array,
    )
    assert_trees_close(actual, expected)


def test_replicated_parameters_stay_bitwise_identical(moe, run_steps):
    state, _ = run_steps(moe, MeshConfig(dp=2, pp=2, ep=2), 2, ADAM, 2)
    for leaf in jax.tree.leaves(state):
        shards_by_index = {}
        for shard in leaf.addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index)
            shards_by_index.setdefault(key, []).append(np.asarray(shard.data))
        for copies in shards_by_index.values():
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0])


def test_frozen_parameters_never_change_and_have_no_optimizer_state(dense, make_batch):
    optimizer = dataclasses.replace(ADAM, freeze=(r"^\.embedding", r"attention\.wq"))
    mesh_config = MeshConfig(dp=2, pp=2, tp=2)
    mesh = make_mesh(mesh_config)
    config = step_config(2, optimizer)
    initial = init_train_state(
        functools.partial(models.DecoderLM, dense), jax.random.key(0), config=config, mesh=mesh
    )
    frozen_before = [
        np.asarray(initial.model.embedding.weight),
        np.asarray(initial.model.blocks.layers.attention.wq),
    ]
    trainable_before = np.asarray(initial.model.blocks.layers.attention.wk)
    adam_state = initial.opt_state[1][0]
    assert (
        adam_state.mu.embedding.weight is None and adam_state.mu.blocks.layers.attention.wq is None
    )
    state, _ = make_train_step(config, mesh)(initial, make_batch(0))
    state, _ = make_train_step(config, mesh)(state, make_batch(1))
    np.testing.assert_array_equal(np.asarray(state.model.embedding.weight), frozen_before[0])
    np.testing.assert_array_equal(
        np.asarray(state.model.blocks.layers.attention.wq), frozen_before[1]
    )
    assert not np.array_equal(np.asarray(state.model.blocks.layers.attention.wk), trainable_before)


@pytest.mark.parametrize("schedule", ["circular", "zb_v"])
def test_per_layer_data_is_staged_with_its_layers_and_never_trained(
    schedule, tiny_config, make_batch
):
    """Gemma 2's sliding windows (every other layer) are integer arrays in the blocks: created
    in the pipeline layout at their layers' places (zb_v's V too), sharded over pp like them,
    outside the optimizer state, unchanged by steps."""
    gemma = tiny_config("gemma2", n_layers=N_LAYERS)
    config = StepConfig(schedule=Schedule(schedule, 2, SHAPE[1], 2), optimizer=ADAM)
    mesh = make_mesh(MeshConfig(dp=2, pp=2, tp=2))
    state = init_train_state(
        functools.partial(models.DecoderLM, gemma), jax.random.key(0), config=config, mesh=mesh
    )
    window = state.model.blocks.layers.attention.window
    assert window.dtype == jnp.int32 and window.shape == (2, 2, 1)
    assert window.sharding.spec[1] == "pp"
    plain_windows = from_pipeline_layout(
        state.model, config.schedule
    ).blocks.layers.attention.window
    np.testing.assert_array_equal(plain_windows, [3, 0, 3, 0])
    adam_state = state.opt_state[1][0]
    assert adam_state.mu.blocks.layers.attention.window is None
    step = make_train_step(config, mesh)
    for index in range(2):
        state, _ = step(state, make_batch(index))
    np.testing.assert_array_equal(
        from_pipeline_layout(state.model, config.schedule).blocks.layers.attention.window,
        [3, 0, 3, 0],
    )


def test_init_on_a_mesh_is_the_plain_model_in_the_pipeline_layout(moe, assert_trees_close):
    """Blocks are created staged (so their RNG splits over pp) but hold the same values as
    `DecoderLM(config, key)` viewed in the pipeline layout."""
    config = step_config(2, ADAM, repeats=2)
    mesh = make_mesh(MeshConfig(dp=2, pp=2, ep=2))
    make_model = functools.partial(models.DecoderLM, moe)
    state = init_train_state(make_model, jax.random.key(3), config=config, mesh=mesh)
    plain = models.DecoderLM(moe, key=jax.random.key(3))
    assert_trees_close(from_pipeline_layout(state.model, config.schedule), plain, rtol=1e-6)


def test_zb_v_places_layers_in_a_v_and_checkpoints_them_in_order(moe, assert_trees_close):
    """Under zb_v stage 0 holds the first and the last chunk of layers. Checkpoints hold the
    layers in order (so a run resumes under any schedule), and come back staged as they
    were; weights loaded from a plain model (Hugging Face's road) are staged the same way."""
    config = StepConfig(schedule=Schedule("zb_v", 2, 2, 2), optimizer=ADAM)
    mesh = make_mesh(MeshConfig(pp=2), jax.devices()[:2])
    make_model = functools.partial(models.DecoderLM, moe)
    state = init_train_state(make_model, jax.random.key(3), config=config, mesh=mesh)
    plain = models.DecoderLM(moe, key=jax.random.key(3))
    staged_up = state.model.blocks.layers.mlp.router.weight
    plain_up = plain.blocks.layers.mlp.router.weight
    np.testing.assert_allclose(staged_up[:, 0, 0], plain_up[jnp.array([0, 3])], rtol=1e-6)
    saved = checkpoint_layout(
        state, train_state_axes(make_model, config=config), config.rules, config.schedule
    )
    assert_trees_close(saved.model, plain, rtol=1e-6)
    target = abstract_train_state(make_model, config=config, mesh=mesh)
    restored = from_checkpoint_layout(saved, target, config.schedule)
    assert_trees_close(restored, state)
    loaded = init_train_state_from(
        make_model, jax.tree.map(np.asarray, plain), config=config, mesh=mesh
    )
    assert_trees_close(loaded.model, state.model, rtol=1e-6)


@pytest.mark.parametrize("schedule", ["circular", "1f1b"])
def test_a_loss_mask_is_normalised_over_the_whole_batch(
    schedule, dense, make_batch, assert_trees_close
):
    """Targets masked unevenly over the accumulation steps (most of the first step's, none
    of the second's) on dp2 x pp2: the loss, its parts and the gradients are those of one
    device over every target token of the batch divided by their number, not the mean of the
    steps' means; the metrics count the targets. (The pipeline grid masks targets with MoE
    aux losses on every schedule and mesh.)"""
    batch = make_batch(0)
    targets = np.asarray(batch["targets"]).copy()
    targets[0, :, :, 1:] = IGNORED
    batch["targets"] = jnp.asarray(targets)
    repeats = 2 if schedule == "circular" else 1
    config = StepConfig(
        schedule=Schedule(schedule, 2, SHAPE[1], repeats),
        optimizer=ADAM,
        loss=LossConfig(z_loss_weight=0.01),
    )
    mesh = make_mesh(MeshConfig(dp=2, pp=2), jax.devices()[:4])
    model = models.DecoderLM(dense, key=jax.random.key(0))
    trainable, frozen = split_trainable(to_pipeline_layout(model, config.schedule), ADAM)
    grads, metrics = jax.jit(step_gradients(config, mesh))(trainable, frozen, batch)

    whole = {name: value.reshape(1, -1, *SHAPE[2:]) for name, value in batch.items()}

    def reference(model):
        return sequential_loss(model, whole["tokens"][0], whole["targets"][0], config=config)

    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(reference, has_aux=True))
    (loss, parts), expected = value_and_grad(model)
    for name in ("cross_entropy", "z_loss"):
        np.testing.assert_allclose(metrics[name], parts[name], rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    grads = from_pipeline_layout(eqx.combine(grads, frozen), config.schedule)
    assert_trees_close(
        eqx.filter(grads, eqx.is_inexact_array), eqx.filter(expected, eqx.is_inexact_array)
    )
    step_cross_entropy = eqx.filter_jit(
        lambda tokens, targets: sequential_loss(model, tokens, targets, config=config)[1][
            "cross_entropy"
        ]
    )
    mean_of_means = (
        sum(step_cross_entropy(batch["tokens"][g], batch["targets"][g]) for g in range(SHAPE[0]))
        / SHAPE[0]
    )
    assert abs(float(mean_of_means) - float(parts["cross_entropy"])) > 1e-3
    expected_targets = int((targets >= 0).sum())
    assert int(metrics["target_tokens"]) == expected_targets
    np.testing.assert_allclose(metrics["masked_fraction"], 1 - expected_targets / targets.size)


def test_non_finite_step_is_skipped_and_counted(dense, make_batch):
    """A NaN loss leaves parameters and optimizer state bitwise unchanged; the next finite
    step updates as usual."""
    config = step_config(1, ADAM)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    make_model = functools.partial(models.DecoderLM, dense)
    state = init_train_state(make_model, jax.random.key(0), config=config, mesh=mesh)

    def poisoned_loss(model, tokens, targets, normalizer, documents):
        loss, metrics = sequential_loss(
            from_pipeline_layout(model, config.schedule),
            tokens,
            targets,
            config=config,
            normalizer=normalizer,
        )
        return jnp.where(tokens[0, 0, 0] == 0, jnp.nan, loss), metrics

    gradients = functools.partial(accumulated_gradients, config=config, loss_fn=poisoned_loss)
    step = jax.jit(lambda s, b: train_step(s, b, config=config, gradients=gradients))
    poisoned = make_batch(0)
    poisoned["tokens"] = poisoned["tokens"].at[0, 0, 0, 0].set(0)
    after, metrics = step(state, poisoned)
    assert int(metrics["skipped"]) == 1
    for a, b in zip(host(after), host(state), strict=True):
        np.testing.assert_array_equal(a, b)
    clean = make_batch(1)
    clean["tokens"] = clean["tokens"].at[0, 0, 0, 0].set(1)
    updated, metrics = step(after, clean)
    assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
    after, updated = updated, step(updated, clean)[0]  # the first update has warmup lr 0
    changed = [not np.array_equal(a, b) for a, b in zip(host(updated.model), host(after.model))]
    assert any(changed) and int(updated.step) == 2


def test_bfloat16_compute_keeps_float32_master_weights(moe, make_batch):
    """bf16 compute through a pp=2 pipeline (stage boundaries in fp32) tracks the fp32 step."""
    mesh = make_mesh(MeshConfig(dp=2, pp=2), jax.devices()[:4])
    losses = {}
    for compute in ("float32", "bfloat16"):
        config = dataclasses.replace(step_config(2, ADAM), precision=Precision(compute=compute))
        make_model = functools.partial(models.DecoderLM, moe)
        state = init_train_state(make_model, jax.random.key(0), config=config, mesh=mesh)
        state, metrics = make_train_step(config, mesh)(state, make_batch(0))
        losses[compute] = float(metrics["loss"])
        assert state.model.blocks.layers.mlp.experts.gate.dtype == jnp.float32
        assert np.isfinite(float(metrics["grad_norm"]))
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=1e-2)


def test_adafactor_is_selectable_and_matches_one_device(dense, run_steps):
    optimizer = dataclasses.replace(ADAM, name="adafactor")
    _, one = run_steps(dense, MeshConfig(), 1, optimizer, 2)
    _, many = run_steps(dense, MeshConfig(dp=2, pp=2, tp=2), 2, optimizer, 2)
    np.testing.assert_allclose(many[1]["loss"], one[1]["loss"], rtol=1e-5)


def test_decay_mask_excludes_norms_and_biases(dense):
    config = dataclasses.replace(dense, qkv_bias=True, attention_sinks=True)
    model = models.DecoderLM(config, key=jax.random.key(0))
    mask = decay_mask(eqx.filter(model, eqx.is_array))
    assert mask.blocks.layers.attention.wq and mask.embedding.weight
    assert not mask.blocks.layers.attention.bq and not mask.blocks.layers.attention_norm.weight
    assert not mask.blocks.layers.attention.sinks
    assert not mask.final_norm.weight


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(n_layers=6, pp=4),
            r"n_layers=6 is not divisible by pp \* repeats = 4 \* 1",
        ),
        (
            dict(n_layers=8, pp=2, repeats=3),
            r"n_layers=8 is not divisible by pp \* repeats = 2 \* 3",
        ),
        (dict(n_heads=6, tp=4), r"n_heads=6 is not divisible by tp=4"),
        (dict(n_experts=6, ep=4), r"n_experts=6 is not divisible by ep=4"),
        (dict(n_experts=None, ep=2), r"ep=2 needs a MoE model"),
    ],
)
def test_mesh_that_does_not_fit_the_model(kwargs, message):
    mesh = {k: kwargs.pop(k) for k in ("pp", "tp", "ep") if k in kwargs}
    model = dict(n_layers=8, n_heads=8, n_experts=8) | kwargs
    with pytest.raises(MeshError, match=message):
        check_model_fits(MeshConfig(**mesh), **model)


def test_init_checks_the_schedule_against_the_mesh(dense):
    config = step_config(2, ADAM)
    with pytest.raises(MeshError, match=r"the schedule has 2 stages but the mesh has pp=4"):
        init_train_state(
            functools.partial(models.DecoderLM, dense),
            jax.random.key(0),
            config=config,
            mesh=make_mesh(MeshConfig(pp=4, dp=2)),
        )
    with pytest.raises(MeshError, match=r"n_layers=4 is not divisible by pp \* repeats = 2 \* 4"):
        init_train_state(
            functools.partial(models.DecoderLM, dense),
            jax.random.key(0),
            config=step_config(2, ADAM, repeats=4),
            mesh=make_mesh(MeshConfig(pp=2), jax.devices()[:2]),
        )


def test_mesh_that_does_not_fit_the_devices():
    with pytest.raises(
        MeshError,
        match=r"mesh dp=2 x pp=2 x tp=4 x ep=1 x cp=1 needs 16 devices, but 8 are available",
    ):
        make_mesh(MeshConfig(dp=2, pp=2, tp=4))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("gpipe", 2, 4, 2), r"gpipe schedule has one repeat per stage, got repeats=2"),
        (
            ("circular", 4, 3, 2),
            r"circular schedule needs microbatches >= stages, got microbatches=3 < stages=4",
        ),
        (("zigzag", 2, 2, 1), r"zigzag"),
    ],
)
def test_impossible_schedules(args, message):
    with pytest.raises((ScheduleError, ConfigError, TypeError), match=message):
        Schedule(*args)


def test_optimizer_config_errors():
    with pytest.raises(
        ConfigError,
        match=r"^warmup_steps: must be in \[0, decay_steps=10\), got 20",
    ):
        OptimizerConfig(warmup_steps=20, decay_steps=10)
    with pytest.raises(ConfigError, match=r"^freeze: bad pattern '\('"):
        OptimizerConfig(freeze=("(",))


class ResidualBlock(eqx.Module):
    """``h + mlp(norm(h))``: a layer with no attention and no auxiliary values."""

    norm: RMSNorm
    mlp: MLP

    def __init__(self, d_model: int, mlp_dim: int, *, key):
        self.norm = RMSNorm(d_model)
        self.mlp = MLP(d_model, mlp_dim, activation="gelu", key=key)

    def __call__(self, h, *, key=None):
        return h + self.mlp(self.norm(h)), {}


class ResidualMLPLM(eqx.Module):
    """A language model that is not a `models.DecoderLM`, written against the model contract
    only: the trainer must pipeline it like any zoo model."""

    embedding: Embedding
    prefix: Stack | None
    blocks: Stack
    unembedding: Linear
    n_layers: int = eqx.field(static=True)

    def __init__(self, *, key, vocab_size=53, d_model=16, mlp_dim=32, n_layers=4):
        embed_key, blocks_key, head_key = jax.random.split(key, 3)
        self.embedding = Embedding(vocab_size, d_model, key=embed_key)
        self.prefix = None
        self.blocks = Stack(
            lambda layer_key: ResidualBlock(d_model, mlp_dim, key=layer_key),
            n_layers,
            key=blocks_key,
        )
        self.unembedding = Linear(
            d_model, vocab_size, in_axis="embed", out_axis="vocab", key=head_key
        )
        self.n_layers = n_layers

    def embed(self, tokens, positions=None):
        del positions  # no position embeddings
        return self.embedding(tokens)

    def head(self, h):
        return self.unembedding(h)

    def head_inputs(self, h):
        return HeadInputs(h, self.unembedding.weight, False, None)

    def block_keys(self, key):
        return jax.random.split(jax.random.split(key, 3)[1], self.n_layers)

    def make_layers(self, layer_keys):
        d_model, mlp_dim = (
            self.embedding.weight.shape[1],
            self.blocks.layers.mlp.up.weight.shape[-1],
        )
        return make_layers_for_keys(lambda k: ResidualBlock(d_model, mlp_dim, key=k), layer_keys)

    def __call__(self, tokens, *, key=None):
        h, _ = self.blocks(self.embed(tokens))
        return self.head(h), {}


def test_a_model_that_is_not_a_decoder_lm_trains_through_the_pipeline(
    run_steps, assert_trees_close
):
    model = ResidualMLPLM(key=jax.random.key(0))
    assert isinstance(model, LanguageModel) and not isinstance(model, models.DecoderLM)
    one_state, one = run_steps(ResidualMLPLM, MeshConfig(), 1, ADAM, 3)
    mesh_state, many = run_steps(ResidualMLPLM, MeshConfig(dp=2, pp=2, tp=2), 2, ADAM, 3, 2)
    for one_metrics, many_metrics in zip(one, many, strict=True):
        np.testing.assert_allclose(many_metrics["loss"], one_metrics["loss"], rtol=1e-5)
    one_plain = from_pipeline_layout(one_state.model, step_config(1, ADAM).schedule)
    assert_trees_close(
        from_pipeline_layout(mesh_state.model, step_config(2, ADAM, 2).schedule), one_plain
    )
    trained = one_plain.blocks.layers.mlp.up.weight
    assert not np.allclose(trained, model.blocks.layers.mlp.up.weight, rtol=1e-3)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_step_temporaries_grow_with_the_vocabulary_by_at_most_its_two_gradients(tied):
    """The compiled one-device step's temporary bytes, vocabulary 4096 against 20480: no
    ``(tokens, vocab)`` logits (the fused loss), no copy of the optimizer's moments (the
    skip is a `jax.lax.cond`), no transposed tied table, and the embedding's gradient table
    allocated only at the end of the backward pass (`eqxzoo.nn.embedding_lookup`). What is
    left to grow is at most the embedding's and the head's gradient (one array when tied)."""
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    config = StepConfig(schedule=Schedule("gpipe", 1, 1, 1), remat_stages=False)
    temp = {}
    for vocab in (4096, 20480):
        model = models.LlamaConfig(
            vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, mlp_dim=128, tie_embeddings=tied
        )
        state = abstract_train_state(
            functools.partial(models.DecoderLM, model), config=config, mesh=mesh
        )
        compiled = compile_train_step(config, mesh, state, (1, 1, 1, 512))
        temp[vocab] = compiled.memory_analysis().temp_size_in_bytes
    vocab_arrays = (temp[20480] - temp[4096]) / ((20480 - 4096) * 64 * 4)
    assert vocab_arrays <= 2.0, temp


def test_the_default_rules_split_the_vocabulary_over_tp_and_pp(dense):
    """The embedding and the output projection live outside the pipeline stages: their
    vocabulary splits over tp and pp (else every stage would hold a whole tp shard of both
    tables), their model dimension over dp; each of the 8 devices holds an eighth."""
    config = step_config(2, ADAM)
    mesh = make_mesh(MeshConfig(dp=2, pp=2, tp=2))
    model_config = dataclasses.replace(dense, vocab_size=64, tie_embeddings=False)
    state = init_train_state(
        functools.partial(models.DecoderLM, model_config),
        jax.random.key(0),
        config=config,
        mesh=mesh,
    )
    assert state.model.embedding.weight.shape == (64, 32)
    assert {shard.data.shape for shard in state.model.embedding.weight.addressable_shards} == {
        (16, 16)
    }
    assert state.model.unembedding.weight.shape == (32, 64)
    assert {shard.data.shape for shard in state.model.unembedding.weight.addressable_shards} == {
        (16, 16)
    }
