"""The zoo models: contract, causality, scan vs unrolled, transformations, configs."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grids import dense_and_one_moe, every_family

import models
from eqxzoo.nn import Axes, documents_of, logical_axes
from eqxzoo.parallel import DEFAULT_RULES, MeshConfig, make_mesh, tree_shardings

SMALL = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=4, mlp_dim=48)
MOE = models.MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=24)

CONFIGS = every_family(
    {
        "llama": models.LlamaConfig(**SMALL, n_kv_heads=2),
        "llama_tied_qknorm": models.LlamaConfig(**SMALL, tie_embeddings=True, qk_norm=True),
        "llama_gelu_layernorm": models.LlamaConfig(**SMALL, activation="gelu", norm="layer"),
        "mixtral": models.MixtralConfig(**SMALL, n_kv_heads=1, moe=MOE),
        "qwen_moe": models.QwenMoeConfig(
            **SMALL,
            n_kv_heads=2,
            moe=dataclasses.replace(MOE, normalize_topk=False, shared_mlp_dim=40, shared_gate=True),
        ),
        "mixtral_capacity": models.MixtralConfig(
            **SMALL, moe=dataclasses.replace(MOE, routing="capacity", capacity_factor=1.0)
        ),
        "llama3_rope": models.LlamaConfig(
            **SMALL, rope_scaling=models.RopeScaling("llama3", 8.0, original_max_positions=32)
        ),
        "mistral_window": models.MistralConfig(**SMALL, sliding_window=4),
        "qwen3_sliding": models.Qwen3Config(
            **SMALL,
            head_dim=16,
            sliding_window=3,
            layer_types=("full_attention", "sliding_attention", "sliding_attention"),
        ),
        "qwen3_moe": models.Qwen3MoeConfig(**SMALL, moe=MOE),
        "gemma2": models.Gemma2Config(**SMALL, sliding_window=5, attention_softcap=5.0),
        "gemma3": models.Gemma3Config(**SMALL, n_kv_heads=1, sliding_window=4),
        "olmo2": models.Olmo2Config(**SMALL, n_kv_heads=2),
        "olmoe": models.OlmoeConfig(**SMALL, clip_qkv=2.0, moe=MOE),
        "gpt2": models.GPT2Config(**SMALL, max_positions=16),
        "gpt_oss": models.GptOssConfig(
            **SMALL,
            n_kv_heads=2,
            sliding_window=4,
            moe=dataclasses.replace(
                models.GptOssConfig().moe, n_experts=4, top_k=2, expert_mlp_dim=24
            ),
        ),
        "deepseek_v3": models.DeepseekV3Config(
            **{**SMALL, "n_layers": 3},
            moe=dataclasses.replace(
                MOE, shared_mlp_dim=24, scoring="sigmoid", n_groups=2, selection_bias=True
            ),
            latent_attention=models.LatentAttentionConfig(
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=8,
            ),
        ),
        "deepseek_v2_lite": models.DeepseekV2Config(
            **{**SMALL, "n_layers": 3},
            moe=dataclasses.replace(MOE, normalize_topk=False, shared_mlp_dim=48),
            latent_attention=models.LatentAttentionConfig(
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
            ),
        ),
    },
    n_layers=3,
    vocab_size=SMALL["vocab_size"],
)


def build(config):
    return models.DecoderLM(config, key=jax.random.key(0))


def tokens(n=12, seed=1):
    return jax.random.randint(jax.random.key(seed), (n,), 0, SMALL["vocab_size"])


@pytest.mark.parametrize("name", CONFIGS)
def test_shapes_dtypes_and_aux(name):
    model = build(CONFIGS[name])
    logits, aux = model(tokens())
    assert logits.shape == (12, 97) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    if model.config.moe is None:
        assert aux == {}
    else:
        assert set(aux) == {
            "load_balance_loss",
            "router_z_loss",
            "expert_fraction",
            "expert_assignments",
            "router_probability",
            "dropped_fraction",
            "padding_fraction",
        }
        n_blocks = model.config.n_blocks  # the MoE layers (DeepSeek's dense prefix has none)
        for name, total in [
            ("expert_fraction", 1),
            ("expert_assignments", model.config.moe.top_k),
            ("router_probability", 1),
        ]:
            assert aux[name].shape == (n_blocks, 4)
            np.testing.assert_allclose(jnp.sum(aux[name], -1), np.full(n_blocks, total), rtol=1e-6)
        assert aux["load_balance_loss"].shape == ()
    assert (model.unembedding is None) == model.config.tie_embeddings


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen_moe", "gemma2", "gpt2"])
def test_causality(name):
    """Changing token t never changes the logits before t (dropless routing is per token)."""
    model = build(CONFIGS[name])
    sequence = tokens(16)
    logits, _ = model(sequence)
    changed, _ = model(sequence.at[9].set((sequence[9] + 5) % 97))
    np.testing.assert_array_equal(logits[:9], changed[:9])
    assert not np.allclose(logits[9:], changed[9:])


@pytest.mark.parametrize(
    ("name", "kernel"),
    [("llama", "dense"), ("gemma2", "blockwise"), ("deepseek_v3", "blockwise"), ("gpt2", "dense")],
)
def test_packed_documents_compute_what_each_document_does_alone(name, kernel):
    """Three documents packed in one sequence (with `Documents` from their segment ids):
    each document's logits are those of the document run alone (fp32, 1e-5), for a plain,
    a windowed and soft-capped, a latent-attention (with a dense prefix and MoE) and a
    learned-position family, on the dense kernel and on the blockwise one with blocks that
    straddle the documents' boundaries."""
    config = dataclasses.replace(CONFIGS[name], attention_kernel=kernel, attention_block_size=4)
    model = build(config)
    lengths = (5, 7, 4)
    sequence = tokens(sum(lengths), seed=3)
    segments = jnp.repeat(jnp.asarray([4, 1, 9]), jnp.asarray(lengths), total_repeat_length=16)
    documents = documents_of(segments)
    packed, _ = model(sequence, documents=documents)
    starts = np.cumsum((0,) + lengths)
    for start, stop in zip(starts[:-1], starts[1:], strict=True):
        alone, _ = model(sequence[start:stop])
        np.testing.assert_allclose(packed[start:stop], alone, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(documents.positions[start:stop], np.arange(stop - start))
    unpacked, _ = model(sequence)
    assert not np.allclose(unpacked[starts[1] :], packed[starts[1] :], atol=1e-3)


@pytest.mark.parametrize("name", ["llama", "qwen_moe"])
def test_scan_equals_unrolled(name):
    scanned = build(CONFIGS[name])
    unrolled = build(dataclasses.replace(CONFIGS[name], scan_layers=False, remat="full"))
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_array_equal(a, b)
    (ls, aux_s), (lu, aux_u) = scanned(tokens()), unrolled(tokens())
    np.testing.assert_allclose(ls, lu, rtol=1e-6, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), aux_s, aux_u)


def _loss(model, batch):
    logits, aux = jax.vmap(model)(batch)
    targets = jnp.roll(batch, -1, axis=-1)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)
    return jnp.mean(nll) + 0.01 * sum(jnp.mean(v) for k, v in aux.items() if k.endswith("loss"))


@pytest.mark.parametrize("name", dense_and_one_moe(CONFIGS))
def test_grad_vmap_and_jit(name):
    model = build(CONFIGS[name])
    batch = jnp.stack([tokens(10, seed=s) for s in range(3)])
    logits, one_sequence = eqx.filter_jit(lambda m, b: (jax.vmap(m)(b)[0], m(b[1])[0]))(
        model, batch
    )
    assert logits.shape == (3, 10, 97)
    np.testing.assert_allclose(logits[1], one_sequence, rtol=1e-5, atol=1e-6)
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(_loss))(model, batch)
    assert np.isfinite(float(loss))
    grad_leaves = jax.tree.leaves(grads)
    assert len(grad_leaves) == len(jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    assert all(np.isfinite(np.asarray(g)).all() for g in grad_leaves)
    assert float(jnp.abs(grads.blocks.layers.attention.wo).sum()) > 0
    # Plain jax.grad over the float arrays (integer per-layer data, such as sliding windows,
    # is not differentiable).
    params, static = eqx.partition(model, eqx.is_inexact_array)
    raw_grads = jax.jit(jax.grad(lambda params: _loss(eqx.combine(params, static), batch)))(params)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), raw_grads, grads
    )


def test_every_parameter_has_logical_axes():
    model = build(CONFIGS["qwen_moe"])
    axes = logical_axes(eqx.filter(model, eqx.is_array))
    leaves = jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, Axes))
    assert len(leaves) == len(jax.tree.leaves(model))
    assert axes.embedding.weight == Axes(("vocab", "embed"))
    assert axes.blocks.layers.attention.wq == Axes(("layers", "embed", "heads", "head_dim"))
    assert axes.blocks.layers.mlp.experts.down == Axes(("layers", "experts", "mlp", "embed"))
    assert axes.unembedding.weight == Axes(("embed", "vocab"))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_family_shards_by_the_rules_table_alone(name):
    """Every array of every family has logical axes that the default rules turn into a
    sharding on a dp x pp x tp mesh: no family needs code of its own to be sharded."""
    model = eqx.filter_eval_shape(models.DecoderLM, CONFIGS[name], key=jax.random.key(0))
    axes = logical_axes(model)
    leaves = jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, Axes))
    assert len(leaves) == len(jax.tree.leaves(model))
    mesh = make_mesh(MeshConfig(dp=2, pp=2, tp=2))
    shardings = tree_shardings(model, axes, mesh, DEFAULT_RULES)
    assert len(jax.tree.leaves(shardings)) == len(leaves)


def test_config_from_a_toml_document():
    import tomllib

    document = tomllib.loads(
        """
        [model]
        family = "mixtral"
        vocab_size = 97
        d_model = 32
        n_layers = 2
        n_heads = 4
        rope_theta = 500000
        [model.moe]
        n_experts = 4
        top_k = 1
        expert_mlp_dim = 24
        routing = "capacity"
        """
    )
    config = models.config_from_table(document["model"])
    assert config == models.MixtralConfig(
        vocab_size=97,
        d_model=32,
        n_layers=2,
        n_heads=4,
        rope_theta=500000.0,
        moe=models.MoEConfig(n_experts=4, top_k=1, expert_mlp_dim=24, routing="capacity"),
    )
    logits, _ = build(config)(tokens())
    assert logits.shape == (12, 97)


def test_config_from_table_builds_each_family():
    table = {
        "family": "qwen_moe",
        **SMALL,
        "moe": {
            "n_experts": 4,
            "top_k": 2,
            "expert_mlp_dim": 24,
            "shared_mlp_dim": 16,
            "shared_gate": True,
        },
    }
    config = models.config_from_table(table)
    assert isinstance(config, models.QwenMoeConfig) and config.moe.shared_gate
    assert config.qkv_bias
    assert isinstance(models.config_from_table({"family": "llama", **SMALL}), models.LlamaConfig)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"family": "gpt5"}, r"model\.family: unknown family 'gpt5'; choose one of"),
        ({"family": "llama", "d_modle": 8}, r"model\.d_modle: unknown key; valid keys are"),
        ({"family": "llama", "d_model": "big"}, r"model\.d_model: expected int, got 'big'"),
        ({"family": "llama", "n_layers": 2.5}, r"model\.n_layers: expected int, got 2\.5"),
        (
            {"family": "llama", "norm": "batch"},
            r"model\.norm: expected 'rms' or 'rms_plus_one' or 'layer', got 'batch'",
        ),
        (
            {"family": "llama", "n_heads": 8, "n_kv_heads": 3},
            r"model\.n_kv_heads: must divide n_heads=8, got 3",
        ),
        (
            {"family": "llama", "d_model": 30, "n_heads": 4},
            r"model\.head_dim: d_model=30 is not divisible by n_heads=4",
        ),
        ({"family": "llama", "moe": {}}, r"model\.moe: llama is dense"),
        (
            {"family": "mixtral", "moe": {"top_k": 9}},
            r"model\.moe\.top_k: must be between 1 and n_experts=8, got 9",
        ),
        (
            {"family": "mixtral", "moe": {"routing": "lossy"}},
            r"model\.moe\.routing: expected 'dropless' or 'capacity' or 'dense'",
        ),
        (
            {"family": "mixtral", "moe": {"shared_mlp_dim": 64}},
            r"model\.moe\.shared_mlp_dim: mixtral has no shared experts",
        ),
        (
            {"family": "qwen_moe", "moe": {"shared_gate": True}},
            r"model\.moe\.shared_gate: needs shared experts",
        ),
        ({"family": "mixtral", "moe": 3}, r"model\.moe: must be a table, got int"),
        (
            {"family": "llama", "remat": "most"},
            r"model\.remat: expected 'none' or 'full' or 'dots', got 'most'",
        ),
    ],
)
def test_config_errors_name_the_field(table, message):
    with pytest.raises(models.ConfigError, match=message):
        models.config_from_table(table)


def test_a_profile_reads_like_the_model():
    """The compiled program's op names carry the model's parts (jax.named_scope)."""
    config = models.QwenMoeConfig(
        vocab_size=32,
        d_model=16,
        n_layers=2,
        n_heads=2,
        moe=models.MoEConfig(n_experts=4, expert_mlp_dim=8, shared_mlp_dim=8, shared_gate=True),
    )
    model = models.DecoderLM(config, key=jax.random.key(0))
    hlo = jax.jit(lambda m, tokens: m(tokens)).lower(model, jnp.arange(8)).compile().as_text()
    for scope in ("attention", "moe/router", "moe/experts", "moe/shared_experts/mlp"):
        assert f"/{scope}/" in hlo, scope
