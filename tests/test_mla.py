"""Multi-head latent attention and YaRN against transformers' DeepSeek-V2/V3 (tiny, in memory,
fp32), and the latent KV cache against attention over the whole sequence."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxzoo.nn import LatentAttention, RopeScaling, cache_slots, deinterleave_rope_columns
from eqxzoo.nn.mla import interleave_rope_columns
from eqxzoo.nn.rope import rope_amplitude, rope_frequencies
from models.config import DecoderConfig
from models.family import HFConfig
from models.hf_rope import read_rope, rope_to_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

BATCH, SEQ, D_MODEL, HEADS = 2, 12, 32, 4
SHAPES = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}


def _yarn_scaling(table: dict) -> RopeScaling:
    return RopeScaling(
        "yarn",
        table["factor"],
        original_max_positions=table["original_max_position_embeddings"],
        beta_fast=table.get("beta_fast", 32.0),
        beta_slow=table.get("beta_slow", 1.0),
        mscale=table.get("mscale"),
        mscale_all_dim=table.get("mscale_all_dim"),
        attention_factor=table.get("attention_factor"),
        truncate=table.get("truncate", True),
    )


@pytest.mark.parametrize(
    "table",
    [
        {"rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
         "mscale": 1.0, "mscale_all_dim": 1.0},
        {"rope_theta": 500.0, "factor": 8.0, "original_max_position_embeddings": 512,
         "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0,
         "truncate": False},
        {"rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 2048,
         "attention_factor": 0.9},
    ],
)  # fmt: skip
def test_yarn_matches_transformers(table):
    head_dim = 64
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=int(table["factor"] * table["original_max_position_embeddings"]),
        rope_parameters={"rope_type": "yarn", **table},
    )
    expected, expected_amplitude = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = _yarn_scaling(table)
    frequencies = rope_frequencies(head_dim, table["rope_theta"], scaling)
    np.testing.assert_allclose(frequencies, expected.numpy(), rtol=1e-6)
    assert rope_amplitude(scaling) == pytest.approx(expected_amplitude, rel=1e-12)
    assert rope_amplitude(RopeScaling("linear", 2.0)) == 1.0


@pytest.mark.parametrize(
    "scaling",
    [
        RopeScaling("yarn", 40.0, original_max_positions=4096, mscale=1.0, mscale_all_dim=1.0),
        RopeScaling("yarn", 4.0, original_max_positions=512, beta_fast=16.0, truncate=False),
        RopeScaling("yarn", 2.0, original_max_positions=2048, attention_factor=0.9),
    ],
)
def test_yarn_config_round_trips_through_hf(scaling):
    config = DecoderConfig(
        vocab_size=11, d_model=16, n_layers=2, n_heads=2, mlp_dim=32, rope_scaling=scaling
    )
    hf_fields = rope_to_hf(config)
    assert hf_fields["rope_parameters"]["rope_type"] == "yarn"
    rope = read_rope(HFConfig(hf_fields, {"rope_theta": 1.0}, "config.json"))
    assert rope == dict(rope_theta=config.rope_theta, rope_scaling=scaling)


def test_reads_deepseek_v3_rope_scaling():
    """DeepSeek-V3's own ``config.json`` (transformers 4 layout: ``rope_scaling`` with ``type``)."""
    values = {
        "rope_theta": 10000,
        "max_position_embeddings": 163840,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    }
    rope = read_rope(HFConfig(values, {"rope_theta": 1.0}, "config.json"))
    expected = RopeScaling(
        "yarn", 40.0, original_max_positions=4096, mscale=1.0, mscale_all_dim=1.0
    )
    assert rope == dict(rope_theta=10000.0, rope_scaling=expected)


def test_rope_column_permutation_round_trips():
    w = np.arange(2 * 14).reshape(2, 14)
    ours = deinterleave_rope_columns(w, 8)
    np.testing.assert_array_equal(ours[:, :6], w[:, :6])
    np.testing.assert_array_equal(ours[0, 6:], [6, 8, 10, 12, 7, 9, 11, 13])
    np.testing.assert_array_equal(interleave_rope_columns(ours, 8), w)


def _hf_attention(version: int, **fields):
    module, config_class, attention_class = {
        2: (modeling_deepseek_v2, transformers.DeepseekV2Config, "DeepseekV2Attention"),
        3: (modeling_deepseek_v3, transformers.DeepseekV3Config, "DeepseekV3Attention"),
    }[version]
    config = config_class(
        hidden_size=D_MODEL,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=1024,
        **SHAPES,
        **fields,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(version)
    attention = getattr(module, attention_class)(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, parameter in attention.named_parameters():
            if "layernorm" in name:
                parameter.copy_(1.0 + 0.3 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.2)
    rotary_class = "DeepseekV2RotaryEmbedding" if version == 2 else "DeepseekV3RotaryEmbedding"
    return config, attention, getattr(module, rotary_class)(config)


def _from_hf(attention, config, interleaved: bool) -> LatentAttention:
    """Our module with the weights of transformers' ``attention``: the conversion of a
    DeepSeek checkpoint's ``self_attn.*`` tensors."""
    table = config.rope_parameters
    scaling = _yarn_scaling(table) if table["rope_type"] == "yarn" else None
    q_lora = config.q_lora_rank
    ours = eqx.filter_eval_shape(
        LatentAttention,
        D_MODEL,
        HEADS,
        q_lora_rank=q_lora,
        rope_theta=table["rope_theta"],
        rope_scaling=scaling,
        attention_bias=config.attention_bias,
        key=jax.random.key(0),
        **SHAPES,
    )
    nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim

    def tensor(name):
        return jnp.asarray(attention.get_parameter(name).detach().numpy())

    def rope_columns(w):
        return deinterleave_rope_columns(w, rope) if interleaved else w

    def heads_in(name):
        w = tensor(name)
        return rope_columns(w.T.reshape(w.shape[1], HEADS, nope + rope))

    fields = {}
    if q_lora is None:
        fields["wq"] = heads_in("q_proj.weight")
    else:
        fields["wq_a"] = tensor("q_a_proj.weight").T
        fields["q_norm.weight"] = tensor("q_a_layernorm.weight")
        fields["wq_b"] = heads_in("q_b_proj.weight")
    fields["wkv_a"] = rope_columns(tensor("kv_a_proj_with_mqa.weight").T)
    fields["kv_norm.weight"] = tensor("kv_a_layernorm.weight")
    fields["wkv_b"] = tensor("kv_b_proj.weight").T.reshape(
        config.kv_lora_rank, HEADS, nope + SHAPES["v_head_dim"]
    )
    fields["wo"] = tensor("o_proj.weight").T.reshape(HEADS, SHAPES["v_head_dim"], D_MODEL)
    if config.attention_bias:
        if q_lora is not None:
            fields["bq_a"] = tensor("q_a_proj.bias")
        fields["bkv_a"] = rope_columns(tensor("kv_a_proj_with_mqa.bias"))
        fields["bo"] = tensor("o_proj.bias")
    for path, value in fields.items():

        def where(m, path=path):
            for part in path.split("."):
                m = getattr(m, part)
            return m

        assert where(ours).shape == value.shape, path
        ours = eqx.tree_at(where, ours, value)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(ours)), "unconverted"
    return ours


@pytest.mark.parametrize(
    "version, fields, interleaved",
    [
        (3, dict(q_lora_rank=24, rope_parameters=YARN), True),
        (3, dict(q_lora_rank=None, rope_parameters=YARN, attention_bias=True), True),
        (3, dict(q_lora_rank=24, attention_bias=True, rope_interleave=False), False),
        (2, dict(q_lora_rank=None, rope_parameters=YARN), True),  # V2-Lite's layout
        (2, dict(q_lora_rank=24, attention_bias=True), True),
    ],
)
def test_latent_attention_matches_transformers(version, fields, interleaved):
    config, attention, rotary = _hf_attention(version, **fields)
    x = np.random.default_rng(version).normal(size=(BATCH, SEQ, D_MODEL)).astype(np.float32)
    x_torch = torch.from_numpy(x)
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        position_embeddings = rotary(x_torch, position_ids)
        expected, _ = attention(
            x_torch, position_embeddings=position_embeddings, attention_mask=mask
        )
    ours = _from_hf(attention, config, interleaved)
    assert ours.scale == pytest.approx(attention.scaling, rel=1e-12)
    np.testing.assert_allclose(
        eqx.filter_jit(ours)(jnp.asarray(x)), expected.numpy(), rtol=1e-5, atol=1e-5
    )


def test_cached_forward_matches_whole_sequence(assert_trees_close):
    attention = eqx.filter_jit(LatentAttention)(
        D_MODEL,
        HEADS,
        q_lora_rank=24,
        rope_scaling=_yarn_scaling({**YARN, "original_max_position_embeddings": 4}),
        key=jax.random.key(1),
        init_std=0.2,
        **SHAPES,
    )
    x = jax.random.normal(jax.random.key(2), (SEQ, D_MODEL))
    expected = eqx.filter_jit(attention)(x)
    slots = 16
    cache = attention.empty_cache(slots, jnp.float32)
    assert [a.shape for a in cache] == [(slots, 16), (slots, 8)]
    cache_positions = jnp.full((slots,), -1)
    step = eqx.filter_jit(attention.cached_forward)
    outputs = []
    for start, end in [(0, 5)] + [(t, t + 1) for t in range(5, SEQ)]:
        out, cache = step(x[start:end], cache, cache_positions, jnp.asarray(start))
        positions = jnp.arange(start, end)
        cache_positions = cache_positions.at[cache_slots(positions, slots)].set(positions)
        outputs.append(out)
    assert [a.shape for a in cache] == [(slots, 16), (slots, 8)]
    np.testing.assert_allclose(jnp.concatenate(outputs), expected, rtol=1e-5, atol=1e-6)
    latent, rope_key = eqx.filter_jit(attention.compress)(x, jnp.arange(SEQ))
    # The cache's rows come from 1- and 5-token matmuls, the reference from one 16-token one:
    # equal up to fp32 rounding, which is relative to each array's scale, not each value's.
    assert_trees_close(cache[0][:SEQ], latent, rtol=1e-6)
    assert_trees_close(cache[1][:SEQ], rope_key, rtol=1e-6)
