"""Hugging Face interop: logits equal to transformers', exact round trips, one-line errors.

Every Hugging Face model here is a tiny random one built in memory (no downloads), run in
float32 with eager attention. Its parameters are re-drawn after construction: transformers
initialises Qwen2-MoE routers to zeros and every norm to ones, which would leave routing
uniform and the mapping of norms untested.
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import safetensors.numpy  # noqa: E402
import safetensors.torch  # noqa: E402
from grids import every_family  # noqa: E402
from hf_models import HF_CASES, VOCAB, ZOO_FAMILY, hf_config, make_hf_model  # noqa: E402

from models import (  # noqa: E402
    ConfigError,
    DecoderConfig,
    DecoderLM,
    Gemma2Config,
    Gemma3Config,
    GPT2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    MoEConfig,
    Olmo2Config,
    OlmoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    QwenMoeConfig,
    RopeScaling,
)
from models.hf import (  # noqa: E402
    HFCheckpointError,
    config_from_hf,
    load_hf,
    per_layer_data,
    save_hf,
)


def tokens_for(case):
    seq = HF_CASES[case][2]
    return np.random.default_rng(seq).integers(0, VOCAB, seq)


def hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor(tokens)[None]).logits[0].numpy()


@eqx.filter_jit
def _zoo_forward(model, tokens):
    return model(tokens)[0]


def zoo_logits(model, tokens):
    # Jitted: compiled once per config and length, shared by the tests of one case.
    return np.asarray(_zoo_forward(model, jnp.asarray(tokens)))


def read_tensors(directory):
    return safetensors.numpy.load_file(str(directory / "model.safetensors"))


def assert_models_equal(actual, expected):
    """Same config, same structure, every array bitwise equal with the same dtype."""
    assert actual.config == expected.config
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree
    for actual_leaf, expected_leaf in zip(actual_leaves, expected_leaves, strict=True):
        assert actual_leaf.dtype == expected_leaf.dtype
        np.testing.assert_array_equal(np.asarray(actual_leaf), np.asarray(expected_leaf))


@pytest.fixture(params=list(HF_CASES))
def hf_checkpoint(request, tmp_path):
    """(case name, randomised transformers model, directory it was saved to)."""
    hf_model = make_hf_model(request.param)
    hf_model.save_pretrained(tmp_path / "hf")
    return request.param, hf_model, tmp_path / "hf"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A saved tiny Llama checkpoint that error tests copy and damage."""
    directory = tmp_path_factory.mktemp("llama")
    make_hf_model("llama_gqa").save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------
# Parity and round trips
# ------------------------------------------------------------------------------------------


def test_logits_match_transformers(hf_checkpoint):
    case, hf_model, directory = hf_checkpoint
    model = load_hf(directory)
    assert type(model.config) is ZOO_FAMILY[HF_CASES[case][0]]
    tokens = tokens_for(case)
    np.testing.assert_allclose(
        zoo_logits(model, tokens), hf_logits(hf_model, tokens), rtol=1e-4, atol=1e-4
    )


def test_save_hf_writes_what_save_pretrained_writes(hf_checkpoint, tmp_path):
    """HF -> zoo -> HF gives back the same tensors, and transformers loads them cleanly."""
    case, hf_model, directory = hf_checkpoint
    model = load_hf(directory)
    save_hf(model, tmp_path / "zoo")

    original, saved = read_tensors(directory), read_tensors(tmp_path / "zoo")
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(saved[name], tensor, err_msg=name)

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "zoo", attn_implementation="eager", output_loading_info=True
    )
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (
        set(),
        set(),
        set(),
    )
    assert type(reloaded) is type(hf_model)
    tokens = tokens_for(case)
    np.testing.assert_allclose(
        hf_logits(reloaded.eval(), tokens), zoo_logits(model, tokens), rtol=1e-4, atol=1e-4
    )


ZOO_CONFIGS = every_family(
    {
        "llama": LlamaConfig(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            mlp_dim=48,
            rope_theta=1000.0,
        ),
        "llama_tied_bias_head_dim": LlamaConfig(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=3,
            n_heads=4,
            head_dim=12,
            mlp_dim=40,
            qkv_bias=True,
            attention_out_bias=True,
            tie_embeddings=True,
            norm_eps=1e-5,
            rope_scaling=RopeScaling("llama3", 8.0, original_max_positions=64),
        ),
        "mixtral": MixtralConfig(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=1,
            mlp_dim=24,
            moe=MoEConfig(n_experts=4, top_k=2, expert_mlp_dim=24),
        ),
        "qwen_moe": QwenMoeConfig(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            mlp_dim=64,
            moe=MoEConfig(
                n_experts=5,
                top_k=2,
                expert_mlp_dim=16,
                normalize_topk=False,
                shared_mlp_dim=24,
                shared_gate=True,
            ),
        ),
        "mistral_dynamic_rope": MistralConfig(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=1,
            mlp_dim=40,
            sliding_window=3,
            rope_scaling=RopeScaling("dynamic", 2.0, original_max_positions=6),
        ),
        "qwen3_sliding": Qwen3Config(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            mlp_dim=40,
            sliding_window=4,
            layer_types=("full_attention", "sliding_attention", "full_attention"),
            tie_embeddings=True,
        ),
        "qwen3_moe": Qwen3MoeConfig(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=2,
            n_heads=4,
            head_dim=8,
            mlp_dim=40,
            qkv_bias=True,
            attention_out_bias=True,
            moe=MoEConfig(n_experts=6, top_k=2, expert_mlp_dim=12, normalize_topk=True),
        ),
        "gemma2": Gemma2Config(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            mlp_dim=40,
            sliding_window=4,
            attention_scale_dim=20,
            attention_softcap=2.0,
            final_softcap=3.0,
        ),
        "gemma3": Gemma3Config(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=2,
            n_heads=2,
            head_dim=16,
            mlp_dim=40,
            sliding_window=3,
            layer_types=("sliding_attention", "full_attention"),
            local_rope_theta=500.0,
            rope_scaling=RopeScaling("linear", 4.0),
            final_softcap=5.0,
            tie_embeddings=False,
        ),
        "olmo2": Olmo2Config(
            vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=40
        ),
        "olmoe": OlmoeConfig(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=2,
            n_heads=4,
            mlp_dim=16,
            clip_qkv=0.7,
            moe=MoEConfig(n_experts=5, top_k=2, expert_mlp_dim=16, normalize_topk=False),
        ),
        "gpt2": GPT2Config(
            vocab_size=VOCAB, d_model=24, n_layers=2, n_heads=3, mlp_dim=56, max_positions=20
        ),
        "gpt_oss": GptOssConfig(
            vocab_size=VOCAB,
            d_model=32,
            n_layers=3,
            n_heads=4,
            n_kv_heads=1,
            head_dim=12,
            mlp_dim=12,
            sliding_window=4,
            layer_types=("full_attention", "sliding_attention", "sliding_attention"),
            tie_embeddings=True,
            moe=MoEConfig(
                n_experts=5,
                top_k=2,
                expert_mlp_dim=12,
                normalize_topk=False,
                scoring="softmax_topk",
                router_bias=True,
                expert_bias=True,
                expert_activation="clamped_swiglu",
                swiglu_limit=0.2,
            ),
        ),
    },
    hf_only=True,
    vocab_size=VOCAB,
)


def random_zoo_model(config, seed=0):
    """A zoo model with every array random: weights N(0, 0.1^2), norms 1 + N(0, 0.1^2).

    Drawn with numpy into the model's abstract skeleton: biases and norms are not left at
    zeros and ones, and no per-shape JAX initialisation has to be compiled.
    """
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = 0.1 * rng.standard_normal(leaf.shape)
        return jnp.asarray(
            1.0 + noise if "norm" in jax.tree_util.keystr(path) else noise, leaf.dtype
        )

    skeleton = eqx.filter_eval_shape(DecoderLM, config, key=jax.random.key(0))
    floats, _ = eqx.partition(skeleton, lambda leaf: jnp.issubdtype(leaf.dtype, jnp.inexact))
    drawn = jax.tree_util.tree_map_with_path(draw, floats)
    return eqx.combine(per_layer_data(DecoderLM, config), drawn)


@pytest.mark.parametrize("name", list(ZOO_CONFIGS))
def test_zoo_round_trip_is_exact_and_loads_in_transformers(name, tmp_path):
    model = random_zoo_model(ZOO_CONFIGS[name])
    save_hf(model, tmp_path)
    assert_models_equal(load_hf(tmp_path), model)

    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (
        set(),
        set(),
        set(),
    )
    tokens = np.random.default_rng(1).integers(0, VOCAB, 10)
    np.testing.assert_allclose(
        hf_logits(hf_model.eval(), tokens), zoo_logits(model, tokens), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("case", ["mixtral_top2_of_4", "qwen_moe_gqa"])
def test_fused_expert_layout_loads(case, tmp_path):
    """transformers 5's in-memory layout (``experts.gate_up_proj``) reads like the Hub's."""
    hf_model = make_hf_model(case)
    hf_model.save_pretrained(tmp_path / "hub")
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    (tmp_path / "fused").mkdir()
    shutil.copy(tmp_path / "hub" / "config.json", tmp_path / "fused" / "config.json")
    safetensors.torch.save_file(
        state, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"}
    )
    assert_models_equal(load_hf(tmp_path / "fused"), load_hf(tmp_path / "hub"))


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = make_hf_model("qwen_moe_gqa")
    hf_model.save_pretrained(tmp_path / "single")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert_models_equal(load_hf(tmp_path / "sharded"), load_hf(tmp_path / "single"))


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path):
    hf_model = make_hf_model("mixtral_top2_of_4").to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert {leaf.dtype for leaf in jax.tree.leaves(model)} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(
        np.asarray(model.embedding.weight).view(np.uint16),
        hf_model.model.embed_tokens.weight.detach().view(torch.int16).numpy().view(np.uint16),
    )
    save_hf(model, tmp_path / "zoo")
    assert json.loads((tmp_path / "zoo" / "config.json").read_text())["dtype"] == "bfloat16"
    assert_models_equal(load_hf(tmp_path / "zoo"), model)


def test_config_reads_old_and_new_rope_theta():
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    assert config_from_hf({**base, "rope_theta": 500000.0}).rope_theta == 500000.0
    new_style = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    assert config_from_hf(new_style).rope_theta == 1234.0
    assert config_from_hf({**base, "rope_scaling": None}).rope_theta == 10000.0  # Llama's default


# ------------------------------------------------------------------------------------------
# Errors a user can cause
# ------------------------------------------------------------------------------------------


def copy_checkpoint(source, destination):
    shutil.copytree(source, destination)
    return destination


def write_config(directory, hf_config_dict):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict))
    return directory


def hf_config_dict(case, **changes):
    architecture, fields, _ = HF_CASES[case]
    config = json.loads(hf_config(architecture, **fields).to_json_string())
    return {**config, "architectures": [architecture], **changes}


def test_unknown_architecture(tmp_path):
    write_config(tmp_path, {"architectures": ["PhiForCausalLM"], "model_type": "phi"})
    with pytest.raises(
        ConfigError,
        match=r"architectures: \['PhiForCausalLM'\] is not supported; "
        r"supported: DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, GPT2LMHeadModel, "
        r"Gemma2ForCausalLM, Gemma3ForCausalLM, GptOssForCausalLM, LlamaForCausalLM, ",
    ):
        load_hf(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(
        HFCheckpointError, match=r"no config\.json \(expected a Hugging Face checkpoint"
    ):
        load_hf(tmp_path)


def test_missing_safetensors(tmp_path, llama_dir):
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(
        HFCheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"
    ):
        load_hf(tmp_path)


def test_missing_shard(tmp_path):
    make_hf_model("llama_mha").save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(HFCheckpointError, match=f"lists shard {shard.name}, which does not exist"):
        load_hf(tmp_path)


def test_missing_tensor(tmp_path, llama_dir):
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    tensors = read_tensors(directory)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.numpy.save_file(
        tensors, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    with pytest.raises(
        HFCheckpointError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"
    ):
        load_hf(directory)


def test_misshaped_tensor(tmp_path, llama_dir):
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    tensors = read_tensors(directory)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 48), np.float32)
    safetensors.numpy.save_file(
        tensors, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    with pytest.raises(
        HFCheckpointError,
        match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \(48, 48\); expected \(32, 48\)",
    ):
        load_hf(directory)


def test_unexpected_tensor(tmp_path, llama_dir):
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    tensors = read_tensors(directory)
    tensors["model.layers.0.mlp.gate_proj.bias"] = np.zeros((64,), np.float32)
    safetensors.numpy.save_file(
        tensors, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    with pytest.raises(
        HFCheckpointError,
        match=r"unexpected tensor\(s\) model\.layers\.0\.mlp\.gate_proj\.bias for LlamaConfig",
    ):
        load_hf(directory)


def test_llama_with_q_k_v_biases_only_saves_a_zero_output_bias(tmp_path):
    """Llama's ``attention_bias`` covers q/k/v and the output: a zoo model with q/k/v biases
    alone is the Hugging Face model whose output bias is zero."""
    config = dataclasses.replace(ZOO_CONFIGS["llama_tied_bias_head_dim"], attention_out_bias=False)
    model = random_zoo_model(config)
    save_hf(model, tmp_path)
    tensors = read_tensors(tmp_path)
    assert not np.any(tensors["model.layers.2.self_attn.o_proj.bias"])
    reloaded = load_hf(tmp_path)
    assert reloaded.config == dataclasses.replace(config, attention_out_bias=True)
    tokens = np.arange(9) % VOCAB
    np.testing.assert_array_equal(zoo_logits(reloaded, tokens), zoo_logits(model, tokens))


@pytest.mark.parametrize(
    ("case", "changes", "message"),
    [
        (
            "llama_mha",
            {"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}},
            r"rope_parameters\.rope_type: 'longrope' is not supported; supported: default, "
            r"linear, dynamic, llama3, yarn",
        ),
        (
            "llama_mha",
            {
                "rope_parameters": None,
                "rope_scaling": {"type": "linear", "factor": 2.0, "attention_factor": 0.5},
                "rope_theta": 1e4,
            },
            r"rope_scaling\.attention_factor: not supported with rope_type 'linear'",
        ),
        ("llama_mha", {"hidden_act": "gelu"}, r"hidden_act: 'gelu' is not supported"),
        (
            "llama_mha",
            {"mlp_bias": True},
            r"mlp_bias: True is not supported: the zoo models LlamaForCausalLM only with "
            r"Hugging Face's default False",
        ),
        (
            "mixtral_top2_of_4",
            {"router_jitter_noise": 0.1},
            r"router_jitter_noise: 0\.1 is not supported: the zoo models MixtralForCausalLM only "
            r"with Hugging Face's default 0\.0",
        ),
        ("qwen_moe_gqa", {"attention_dropout": 0.1}, r"attention_dropout: 0\.1 is not supported"),
        (
            "llama_mha",
            {"quantization_config": {"quant_method": "fp8"}},
            r"quantization_config: \{'quant_method': 'fp8'\}: an option of LlamaForCausalLM the "
            r"zoo does not model",
        ),
        (
            "mistral_window",
            {"attention_bias": True},
            r"attention_bias: True: an option of MistralForCausalLM the zoo does not model",
        ),
        (
            "qwen3_tied",
            {"layer_types": ["full_attention", "sliding_attention"]},
            r"layer_types: sliding_attention layers need use_sliding_window = true",
        ),
        (
            "qwen3_moe_norm_topk",
            {"mlp_only_layers": [0]},
            r"mlp_only_layers: \[0\] makes layers \[0\] dense: the zoo stacks equal layers",
        ),
        (
            "qwen3_moe_norm_topk",
            {"decoder_sparse_step": 2},
            r"decoder_sparse_step: 2 makes layers \[0\] dense",
        ),
        (
            "gemma2_softcapped",
            {"use_bidirectional_attention": True},
            r"use_bidirectional_attention: True: only causal attention is supported",
        ),
        (
            "gemma3_local_global",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            r"rope_parameters\.sliding_attention\.rope_type: 'linear': sliding-window layers' "
            r"rotary embeddings must be unscaled",
        ),
        (
            "olmo2_gqa",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            r"rope_parameters\.partial_rotary_factor: partial rotary embeddings are not supported",
        ),
        ("olmoe_clip", {"hidden_act": "gelu"}, r"hidden_act: 'gelu' is not supported"),
        (
            "gpt2_tied",
            {"activation_function": "relu"},
            r"activation_function: 'relu' is not supported; supported: gelu_new",
        ),
        (
            "gpt2_tied",
            {"scale_attn_by_inverse_layer_idx": True},
            r"scale_attn_by_inverse_layer_idx: True is not supported: the zoo models "
            r"GPT2LMHeadModel only with Hugging Face's default False",
        ),
        ("qwen_moe_gqa", {"mlp_only_layers": [1]}, r"mlp_only_layers: \[1\]: dense layers"),
        ("qwen_moe_gqa", {"decoder_sparse_step": 2}, r"decoder_sparse_step: 2: only 1"),
        (
            "qwen_moe_gqa",
            {"use_sliding_window": True},
            r"use_sliding_window: sliding-window attention",
        ),
        ("llama_mha", {"num_key_value_heads": 3}, r"n_kv_heads: must divide n_heads=4, got 3"),
        (
            "gpt_oss_sliding_sinks",
            {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}},
            r"quantization_config: MXFP4 checkpoints are not supported: dequantise first",
        ),
        (
            "gpt_oss_sliding_sinks",
            {"quantization_config": {"quant_method": "fp8"}},
            r"quantization_config: \{'quant_method': 'fp8'\}: quantised checkpoints are not "
            r"supported; dequantise first",
        ),
        (
            "gpt_oss_sliding_sinks",
            {"layer_types": ["sliding_attention"]},
            r"layer_types: \['sliding_attention'\]: expected 2 entries",
        ),
        (
            "gpt_oss_sliding_sinks",
            {"sliding_window": None},
            r"sliding_window: null is not supported: GPT-OSS's sliding layers need a window",
        ),
        (
            "gpt_oss_sliding_sinks",
            {"router_jitter_noise": 0.1},
            r"router_jitter_noise: 0\.1: an option of GptOssForCausalLM the zoo does not model",
        ),
    ],
)
def test_unsupported_hf_config(case, changes, message, tmp_path):
    """Each family whitelists the config.json keys it reads or may ignore; any other key
    whose value differs from Hugging Face's default is refused, naming it."""
    write_config(tmp_path, hf_config_dict(case, **changes))
    with pytest.raises(ConfigError, match=message) as error:
        load_hf(tmp_path)
    assert str(tmp_path / "config.json") in str(error.value)
    assert "\n" not in str(error.value)


def test_gpt_oss_config_keeps_a_window():
    """Read with the keys of OpenAI's released config.json that transformers ignores."""
    released_keys = dict(experts_per_token=2, initial_context_length=4096)
    config = config_from_hf(hf_config_dict("gpt_oss_sliding_sinks", **released_keys))
    assert config.attention_layer_types == ("sliding_attention", "full_attention")
    with pytest.raises(ConfigError, match=r"^sliding_window: GPT-OSS keeps a window: to have"):
        dataclasses.replace(config, sliding_window=None)


def test_gpt_oss_without_rope_settings_reads_transformers_default_yarn():
    architecture, fields, _ = HF_CASES["gpt_oss_sliding_sinks"]
    values = hf_config(architecture, **fields).to_dict()
    del values["rope_parameters"]
    config = config_from_hf(values)
    assert config.rope_scaling == RopeScaling(
        "yarn", 32.0, original_max_positions=4096, truncate=False
    )


def test_keys_at_their_defaults_or_ignorable_are_accepted():
    config = hf_config_dict(
        "mixtral_top2_of_4",
        router_jitter_noise=0.0,
        attention_dropout=0.0,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
        some_future_option=None,
    )
    assert isinstance(config_from_hf(config), MixtralConfig)


TINY = dict(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, mlp_dim=16)
TINY_MOE = MoEConfig(n_experts=2, top_k=1, expert_mlp_dim=8)
GPT_OSS_MOE = dataclasses.replace(GptOssConfig().moe, n_experts=2, top_k=1, expert_mlp_dim=8)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LlamaConfig(**TINY, norm="layer"), r"norm: 'layer' has no LlamaForCausalLM counterpart"),
        (
            LlamaConfig(**TINY, activation="gelu"),
            r"activation: 'gelu' has no LlamaForCausalLM counterpart",
        ),
        (
            LlamaConfig(**TINY, qk_norm=True),
            r"qk_norm: True has no LlamaForCausalLM counterpart; use False",
        ),
        (
            Qwen3Config(**TINY, norm_position="post"),
            r"norm_position: 'post' has no Qwen3ForCausalLM counterpart; use 'pre'",
        ),
        (
            Gemma3Config(**TINY, attention_softcap=50.0),
            r"attention_softcap: 50\.0 has no Gemma3ForCausalLM counterpart; use None",
        ),
        (
            GPT2Config(**TINY, n_kv_heads=1),
            r"n_kv_heads: GPT2LMHeadModel has as many key/value heads as heads",
        ),
        (
            Olmo2Config(**TINY, qkv_bias=True),
            r"attention_out_bias: Olmo2ForCausalLM has q/k/v and output biases or neither",
        ),
        (DecoderConfig(**TINY), r"family: 'decoder' has no Hugging Face architecture"),
        (
            MixtralConfig(**TINY, qkv_bias=True, moe=TINY_MOE),
            r"qkv_bias: True has no MixtralForCausalLM counterpart; use False",
        ),
        (
            MixtralConfig(**TINY, moe=dataclasses.replace(TINY_MOE, normalize_topk=False)),
            r"moe\.normalize_topk: MixtralForCausalLM always renormalises",
        ),
        (
            QwenMoeConfig(**TINY, moe=TINY_MOE),
            r"moe\.shared_mlp_dim: Qwen2MoeForCausalLM always has a gated",
        ),
        (
            MixtralConfig(**TINY, moe=dataclasses.replace(TINY_MOE, expert_bias=True)),
            r"moe\.expert_bias: True has no MixtralForCausalLM counterpart; use False",
        ),
        (
            QwenMoeConfig(
                **TINY,
                moe=dataclasses.replace(
                    TINY_MOE, shared_mlp_dim=16, shared_gate=True, scoring="sigmoid"
                ),
            ),
            r"moe\.scoring: 'sigmoid' has no Qwen2MoeForCausalLM counterpart; use 'softmax'",
        ),
        (
            MixtralConfig(**TINY, moe=dataclasses.replace(TINY_MOE, n_groups=2)),
            r"moe\.n_groups: 2 has no MixtralForCausalLM counterpart; use 1",
        ),
        (
            GptOssConfig(**TINY, attention_sinks=False, moe=GPT_OSS_MOE),
            r"attention_sinks: False has no GptOssForCausalLM counterpart; use True",
        ),
        (
            GptOssConfig(**TINY, attention_out_bias=False, moe=GPT_OSS_MOE),
            r"attention_out_bias: GptOssForCausalLM has q/k/v and output biases or neither",
        ),
    ],
)
def test_save_rejects_configs_hf_cannot_represent(config, message, tmp_path):
    model = random_zoo_model(config)
    with pytest.raises(ConfigError, match=message):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
