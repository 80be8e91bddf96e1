"""Hugging Face interop: load and save ``LlamaForCausalLM``, ``MixtralForCausalLM`` and
``Qwen2MoeForCausalLM`` checkpoint directories as zoo `DecoderLM` models.

    model = load_hf("path/to/hf-checkpoint")   # config.json + model.safetensors (or shards)
    save_hf(model, "path/to/out")              # loads with AutoModelForCausalLM.from_pretrained

Only files are read and written (``config.json``, safetensors): neither transformers nor torch
is imported. ``safetensors`` comes with the ``hf`` extra.

Layouts. Hugging Face stores a linear layer's weight output-major ``(out, in)``; the zoo keeps
``(in, out)`` and per-head attention weights (``wq: (embed, heads, head_dim)``), so every
tensor is transposed and reshaped on the way in and out; per-layer tensors are stacked on the
zoo's leading ``layers`` axis. Expert weights are read in either of the two layouts found in
the wild: the Hub's one tensor per expert (``...experts.{e}.w1.weight`` for Mixtral,
``...experts.{e}.gate_proj.weight`` for Qwen2-MoE; what ``save_pretrained`` of transformers 5
writes too) or transformers 5's in-memory fused layout (``experts.gate_up_proj`` of shape
``(experts, 2 * mlp, embed)`` and ``experts.down_proj`` of shape ``(experts, embed, mlp)``).
`save_hf` writes the Hub layout.

Anything the zoo cannot represent exactly (scaled rotary embeddings, sliding windows, dense
layers inside a Qwen2-MoE, MLP biases, an activation other than SiLU, a non-zero Llama output
projection bias...) is refused with one line naming the field or tensor, never approximated.
"""

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from models.config import (
    ConfigError,
    DecoderConfig,
    LlamaConfig,
    MixtralConfig,
    MoEConfig,
    QwenMoeConfig,
)
from models.decoder import DecoderLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# Hugging Face architecture -> (model_type, zoo config class).
ARCHITECTURES: dict[str, tuple[str, type[DecoderConfig]]] = {
    "LlamaForCausalLM": ("llama", LlamaConfig),
    "MixtralForCausalLM": ("mixtral", MixtralConfig),
    "Qwen2MoeForCausalLM": ("qwen2_moe", QwenMoeConfig),
}

# Hugging Face's defaults for the optional fields we read, per model type.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "qkv_bias": True,
    },
}


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint's files or tensors do not match what its config describes."""


def _config_error(where: str, field: str, problem: str) -> ConfigError:
    return ConfigError(f"{where}: {field}: {problem}")


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def config_from_hf(hf_config: Mapping[str, Any], *, where: str = CONFIG_NAME) -> DecoderConfig:
    """The zoo config (`LlamaConfig`, `MixtralConfig` or `QwenMoeConfig`) for a ``config.json``.

    Raises `ConfigError` naming the field for anything the zoo cannot represent exactly;
    ``where`` prefixes the message (the file's path).
    """
    model_type = _model_type(hf_config, where)
    defaults = _DEFAULTS[model_type]

    def get(key: str, default: Any = None) -> Any:
        value = hf_config.get(key)
        if value is not None:
            return value
        if default is not None:
            return default
        if key in defaults:
            return defaults[key]
        raise _config_error(where, key, "missing: a Hugging Face config must set it")

    if "quantization_config" in hf_config:
        raise _config_error(where, "quantization_config", "quantized checkpoints are not supported")
    if get("hidden_act", "silu") != "silu":
        raise _config_error(
            where,
            "hidden_act",
            f"{hf_config['hidden_act']!r} is not supported: the zoo's SwiGLU uses 'silu'",
        )
    n_heads = get("num_attention_heads")
    d_model = get("hidden_size")
    head_dim = get("head_dim", d_model // n_heads)
    n_kv_heads = get("num_key_value_heads", n_heads)
    common = dict(
        vocab_size=get("vocab_size"),
        d_model=d_model,
        n_layers=get("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        mlp_dim=get("intermediate_size"),
        activation="swiglu",
        norm="rms",
        norm_eps=float(get("rms_norm_eps")),
        rope_theta=_rope_theta(hf_config, defaults["rope_theta"], where),
        qk_norm=False,
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        init_std=float(get("initializer_range", 0.02)),
    )

    if model_type == "llama":
        if hf_config.get("mlp_bias"):
            raise _config_error(
                where, "mlp_bias", "MLP biases are not supported: the zoo's MLP has none"
            )
        config_class, extra = (
            LlamaConfig,
            dict(qkv_bias=bool(hf_config.get("attention_bias", False))),
        )
    elif model_type == "mixtral":
        if hf_config.get("sliding_window") is not None:
            raise _config_error(
                where,
                "sliding_window",
                f"{hf_config['sliding_window']}: sliding-window attention is not supported; set it to null",
            )
        moe = MoEConfig(
            n_experts=get("num_local_experts"),
            top_k=get("num_experts_per_tok"),
            expert_mlp_dim=get("intermediate_size"),
            normalize_topk=True,
        )
        config_class, extra = MixtralConfig, dict(qkv_bias=False, moe=moe)
    else:
        _check_qwen_moe_layers(hf_config, common["n_layers"], where)
        moe = MoEConfig(
            n_experts=get("num_experts"),
            top_k=get("num_experts_per_tok"),
            expert_mlp_dim=get("moe_intermediate_size"),
            normalize_topk=bool(get("norm_topk_prob")),
            shared_mlp_dim=get("shared_expert_intermediate_size"),
            shared_gate=True,
        )
        config_class, extra = QwenMoeConfig, dict(qkv_bias=bool(get("qkv_bias")), moe=moe)
    try:
        return config_class(**common, **extra)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def config_to_hf(config: DecoderConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` contents describing ``config`` to Hugging Face transformers.

    ``dtype`` is the parameters' dtype name (``"float32"``, ``"bfloat16"``). Raises
    `ConfigError` naming the field if the config has no exact Hugging Face counterpart.
    ``scan_layers``, ``remat``, ``moe.routing`` and ``moe.capacity_factor`` choose how the
    zoo runs the same parameters and are not saved.
    """
    architecture = _check_representable(config)
    model_type = ARCHITECTURES[architecture][0]
    hf_config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.attention_head_dim,
        "intermediate_size": config.mlp_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    moe = config.moe
    if model_type == "llama":
        hf_config.update(attention_bias=config.qkv_bias, mlp_bias=False)
    elif model_type == "mixtral":
        hf_config.update(
            intermediate_size=moe.expert_mlp_dim,
            num_local_experts=moe.n_experts,
            num_experts_per_tok=moe.top_k,
            sliding_window=None,
        )
    else:
        hf_config.update(
            num_experts=moe.n_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.expert_mlp_dim,
            shared_expert_intermediate_size=moe.shared_mlp_dim,
            norm_topk_prob=moe.normalize_topk,
            qkv_bias=config.qkv_bias,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
        )
    return hf_config


def _model_type(hf_config: Mapping[str, Any], where: str) -> str:
    """The model type named by ``architectures`` (or, lacking it, ``model_type``)."""
    supported = ", ".join(ARCHITECTURES)
    architectures = hf_config.get("architectures")
    if architectures:
        known = [name for name in architectures if name in ARCHITECTURES]
        if len(known) != 1:
            raise _config_error(
                where,
                "architectures",
                f"{list(architectures)} is not supported; supported: {supported}",
            )
        model_type = ARCHITECTURES[known[0]][0]
        if hf_config.get("model_type", model_type) != model_type:
            raise _config_error(
                where,
                "model_type",
                f"{hf_config['model_type']!r} does not match architecture {known[0]}",
            )
        return model_type
    model_type = hf_config.get("model_type")
    if model_type in {model_type for model_type, _ in ARCHITECTURES.values()}:
        return model_type
    raise _config_error(
        where,
        "architectures",
        f"missing, and model_type {model_type!r} is not supported; supported: {supported}",
    )


def _rope_theta(hf_config: Mapping[str, Any], default: float, where: str) -> float:
    """``rope_theta`` from ``rope_parameters`` (transformers 5) or the top level (older).

    Only unscaled ("default") rotary embeddings over the whole head exist in the zoo.
    """
    for field in ("rope_parameters", "rope_scaling"):
        table = hf_config.get(field) or {}
        if not isinstance(table, Mapping) or any(
            isinstance(value, Mapping) for value in table.values()
        ):
            raise _config_error(
                where, field, f"{table!r}: per-layer rotary settings are not supported"
            )
        rope_type = table.get("rope_type", table.get("type", "default"))
        if rope_type != "default":
            raise _config_error(
                where,
                f"{field}.rope_type",
                f"{rope_type!r}: only unscaled ('default') rotary embeddings are supported",
            )
        if table.get("partial_rotary_factor", 1.0) != 1.0:
            raise _config_error(
                where,
                f"{field}.partial_rotary_factor",
                "partial rotary embeddings are not supported",
            )
    if hf_config.get("partial_rotary_factor", 1.0) != 1.0:
        raise _config_error(
            where, "partial_rotary_factor", "partial rotary embeddings are not supported"
        )
    parameters = hf_config.get("rope_parameters") or {}
    theta = parameters.get("rope_theta", hf_config.get("rope_theta"))
    return float(default if theta is None else theta)


def _check_qwen_moe_layers(hf_config: Mapping[str, Any], n_layers: int, where: str) -> None:
    """Every Qwen2-MoE layer must be a full-attention MoE layer, as every zoo layer is."""
    if hf_config.get("mlp_only_layers"):
        raise _config_error(
            where,
            "mlp_only_layers",
            f"{hf_config['mlp_only_layers']}: dense layers between MoE layers are not supported",
        )
    if hf_config.get("decoder_sparse_step", 1) != 1:
        raise _config_error(
            where,
            "decoder_sparse_step",
            f"{hf_config['decoder_sparse_step']}: only 1 (every layer a MoE) is supported",
        )
    if hf_config.get("use_sliding_window"):
        raise _config_error(
            where,
            "use_sliding_window",
            "sliding-window attention is not supported; set it to false",
        )
    layer_types = hf_config.get("layer_types") or ["full_attention"] * n_layers
    if any(layer_type != "full_attention" for layer_type in layer_types):
        raise _config_error(
            where, "layer_types", f"{layer_types}: only 'full_attention' layers are supported"
        )


def _check_representable(config: DecoderConfig) -> str:
    """The Hugging Face architecture for ``config``, or `ConfigError` naming what has none."""
    architecture = {config_class: name for name, (_, config_class) in ARCHITECTURES.items()}.get(
        type(config)
    )
    if architecture is None:
        raise ConfigError(
            f"family: {config.family!r} has no Hugging Face architecture; "
            "use LlamaConfig, MixtralConfig or QwenMoeConfig"
        )
    if config.norm != "rms":
        raise ConfigError(f"norm: {config.norm!r} has no {architecture} counterpart; use 'rms'")
    if config.activation != "swiglu":
        raise ConfigError(
            f"activation: {config.activation!r} has no {architecture} counterpart; use 'swiglu'"
        )
    if config.qk_norm:
        raise ConfigError(f"qk_norm: {architecture} has no QK-norm; set qk_norm=False")
    moe = config.moe
    if architecture == "MixtralForCausalLM":
        if config.qkv_bias:
            raise ConfigError(
                "qkv_bias: MixtralForCausalLM has no attention biases; set qkv_bias=False"
            )
        if not moe.normalize_topk:
            raise ConfigError(
                "moe.normalize_topk: MixtralForCausalLM always renormalises; set it to True"
            )
    if architecture == "Qwen2MoeForCausalLM" and not (moe.shared_mlp_dim > 0 and moe.shared_gate):
        raise ConfigError(
            "moe.shared_mlp_dim: Qwen2MoeForCausalLM always has a gated shared expert; "
            "set shared_mlp_dim > 0 and shared_gate=True"
        )
    return architecture


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _import_safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ImportError(
            "Hugging Face conversion needs safetensors: pip install 'eqxzoo[hf]'"
        ) from None
    return safetensors


class _Checkpoint:
    """The tensors of one or more safetensors files, read lazily by name.

    ``entries`` maps the name a tensor is read by to its file and its name in that file (they
    differ after `rename`). Tracks which tensors were read, so that tensors nobody asked for
    can be reported.
    """

    def __init__(self, directory: Path):
        self.safetensors = _import_safetensors()
        single, index = directory / WEIGHTS_NAME, directory / WEIGHTS_INDEX_NAME
        if single.is_file():
            with self.safetensors.safe_open(single, framework="numpy") as handle:
                self.entries = {key: (single, key) for key in handle.keys()}
        elif index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFCheckpointError(f"{index}: no 'weight_map' table")
            self.entries = {key: (directory / file, key) for key, file in weight_map.items()}
            for file in sorted({file for file, _ in self.entries.values()}):
                if not file.is_file():
                    raise HFCheckpointError(
                        f"{index}: lists shard {file.name}, which does not exist"
                    )
        else:
            raise HFCheckpointError(
                f"{directory}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} "
                "(only safetensors checkpoints can be read; re-save with safe_serialization=True)"
            )
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def rename(self, old: str, new: str) -> None:
        """Read tensors whose names contain ``old`` by names containing ``new`` instead."""
        self.entries = {key.replace(old, new): entry for key, entry in self.entries.items()}

    def read(self, key: str, shape: tuple[int, ...] | None) -> np.ndarray:
        """The tensor ``key``, checked to be floating point and of ``shape`` (if given)."""
        if key not in self.entries:
            raise HFCheckpointError(f"tensor {key} is missing from the checkpoint")
        file, name = self.entries[key]
        with self.safetensors.safe_open(file, framework="numpy") as handle:
            try:
                array = handle.get_tensor(name)
            except (TypeError, ValueError):
                # A safetensors without ml_dtypes support cannot give bfloat16 to numpy.
                with self.safetensors.safe_open(file, framework="flax") as flax_handle:
                    array = np.asarray(flax_handle.get_tensor(name))
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise HFCheckpointError(
                f"tensor {name} has dtype {array.dtype}; expected a float tensor"
            )
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise HFCheckpointError(
                f"tensor {name} has shape {tuple(array.shape)}; expected {tuple(shape)}"
            )
        self.used.add(key)
        return array

    def unused(self) -> list[str]:
        """Names (as stored) of the tensors never read."""
        return sorted(name for key, (_, name) in self.entries.items() if key not in self.used)


class _LayerReader:
    """Reads one layer's (or the model's top-level) tensors by name relative to ``prefix``.

    Shapes are checked against ``expected`` (what `save_hf` would write for the config)
    unless the caller gives one.
    """

    def __init__(self, checkpoint: _Checkpoint, prefix: str, expected: Mapping[str, Any]):
        self.checkpoint = checkpoint
        self.prefix = prefix
        self.expected = expected

    def has(self, name: str) -> bool:
        return self.prefix + name in self.checkpoint

    def __call__(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        key = self.prefix + name
        if shape is None and key in self.expected:
            shape = tuple(self.expected[key].shape)
        return self.checkpoint.read(key, shape)


# --------------------------------------------------------------------------------------------
# Tensor layouts
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One zoo array and how it is stored in a Hugging Face checkpoint.

    ``where`` picks the array from a `DecoderLM` (for ``layered`` arrays, the array stacked
    over layers). ``to_hf`` maps one layer's array to ``{name: tensor}`` (names relative to
    ``model.layers.{i}.`` for layered arrays); ``from_hf`` rebuilds it, given a reader of
    those names and the array's per-layer shape. Both only use ``.T``, ``.reshape`` and
    indexing, so they run on numpy arrays and on abstract JAX values alike.
    """

    where: Callable[[DecoderLM], Any]
    layered: bool
    to_hf: Callable[[Any], dict[str, Any]]
    from_hf: Callable[[_LayerReader, tuple[int, ...]], np.ndarray]


def _copied(where: Callable, name: str, *, layered: bool = True) -> _Tensor:
    """Norm weights and the embedding table: same layout on both sides."""
    return _Tensor(where, layered, lambda a: {name: a}, lambda read, shape: read(name))


def _linear(where: Callable, name: str, *, layered: bool = True) -> _Tensor:
    """A `Linear` weight ``(in, out)`` <-> a torch ``nn.Linear`` weight ``(out, in)``."""
    return _Tensor(where, layered, lambda a: {name: a.T}, lambda read, shape: read(name).T)


def _heads_in(where: Callable, name: str) -> _Tensor:
    """``wq/wk/wv (embed, heads, head_dim)`` <-> ``q/k/v_proj.weight (heads * head_dim, embed)``."""
    return _Tensor(
        where,
        True,
        lambda a: {name: a.reshape(a.shape[0], -1).T},
        lambda read, shape: read(name).T.reshape(shape),
    )


def _heads_out(where: Callable, name: str) -> _Tensor:
    """``wo (heads, head_dim, embed)`` <-> ``o_proj.weight (embed, heads * head_dim)``."""
    return _Tensor(
        where,
        True,
        lambda a: {name: a.reshape(-1, a.shape[-1]).T},
        lambda read, shape: read(name).T.reshape(shape),
    )


def _heads_bias(where: Callable, name: str) -> _Tensor:
    """``bq/bk/bv (heads, head_dim)`` <-> ``q/k/v_proj.bias (heads * head_dim,)``."""
    return _Tensor(
        where, True, lambda a: {name: a.reshape(-1)}, lambda read, shape: read(name).reshape(shape)
    )


def _experts(where: Callable, prefix: str, expert_name: str, fused: str) -> _Tensor:
    """Stacked expert weights ``(experts, in, out)`` <-> one ``(out, in)`` tensor per expert.

    Also reads transformers 5's fused layout: ``fused`` is ``"gate"`` or ``"up"`` (a half of
    ``experts.gate_up_proj (experts, 2 * mlp, embed)``) or ``"down"`` (``experts.down_proj
    (experts, embed, mlp)``).
    """

    def name(expert: int) -> str:
        return f"{prefix}experts.{expert}.{expert_name}.weight"

    def to_hf(a) -> dict[str, Any]:
        return {name(expert): a[expert].T for expert in range(a.shape[0])}

    def from_hf(read: _LayerReader, shape: tuple[int, ...]) -> np.ndarray:
        n_experts, rows, columns = shape
        if fused == "down" and read.has(f"{prefix}experts.down_proj"):
            return read(f"{prefix}experts.down_proj", (n_experts, columns, rows)).transpose(0, 2, 1)
        if fused in ("gate", "up") and read.has(f"{prefix}experts.gate_up_proj"):
            gate_up = read(f"{prefix}experts.gate_up_proj", (n_experts, 2 * columns, rows))
            half = gate_up[:, :columns] if fused == "gate" else gate_up[:, columns:]
            return half.transpose(0, 2, 1)
        return np.stack([read(name(expert)).T for expert in range(n_experts)])

    return _Tensor(where, True, to_hf, from_hf)


def _tensors(config: DecoderConfig) -> list[_Tensor]:
    """Every array of a `DecoderLM` with ``config`` and its Hugging Face name(s) and layout."""
    model_type = ARCHITECTURES[_check_representable(config)][0]
    tensors = [
        _copied(lambda m: m.embedding.weight, "model.embed_tokens.weight", layered=False),
        _copied(lambda m: m.final_norm.weight, "model.norm.weight", layered=False),
        _copied(lambda m: m.blocks.layers.attention_norm.weight, "input_layernorm.weight"),
        _copied(lambda m: m.blocks.layers.mlp_norm.weight, "post_attention_layernorm.weight"),
        _heads_in(lambda m: m.blocks.layers.attention.wq, "self_attn.q_proj.weight"),
        _heads_in(lambda m: m.blocks.layers.attention.wk, "self_attn.k_proj.weight"),
        _heads_in(lambda m: m.blocks.layers.attention.wv, "self_attn.v_proj.weight"),
        _heads_out(lambda m: m.blocks.layers.attention.wo, "self_attn.o_proj.weight"),
    ]
    if not config.tie_embeddings:
        tensors.append(_linear(lambda m: m.unembedding.weight, "lm_head.weight", layered=False))
    if config.qkv_bias:
        tensors += [
            _heads_bias(lambda m: m.blocks.layers.attention.bq, "self_attn.q_proj.bias"),
            _heads_bias(lambda m: m.blocks.layers.attention.bk, "self_attn.k_proj.bias"),
            _heads_bias(lambda m: m.blocks.layers.attention.bv, "self_attn.v_proj.bias"),
        ]
    if model_type == "llama":
        return tensors + [
            _linear(lambda m: m.blocks.layers.mlp.gate.weight, "mlp.gate_proj.weight"),
            _linear(lambda m: m.blocks.layers.mlp.up.weight, "mlp.up_proj.weight"),
            _linear(lambda m: m.blocks.layers.mlp.down.weight, "mlp.down_proj.weight"),
        ]
    if model_type == "mixtral":
        prefix, names = "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        prefix, names = "mlp.", ("gate_proj", "up_proj", "down_proj")
    tensors += [
        _linear(lambda m: m.blocks.layers.mlp.router.weight, f"{prefix}gate.weight"),
        _experts(lambda m: m.blocks.layers.mlp.experts.gate, prefix, names[0], "gate"),
        _experts(lambda m: m.blocks.layers.mlp.experts.up, prefix, names[1], "up"),
        _experts(lambda m: m.blocks.layers.mlp.experts.down, prefix, names[2], "down"),
    ]
    if model_type == "qwen2_moe":
        tensors += [
            _linear(
                lambda m: m.blocks.layers.mlp.shared.gate.weight,
                "mlp.shared_expert.gate_proj.weight",
            ),
            _linear(
                lambda m: m.blocks.layers.mlp.shared.up.weight, "mlp.shared_expert.up_proj.weight"
            ),
            _linear(
                lambda m: m.blocks.layers.mlp.shared.down.weight,
                "mlp.shared_expert.down_proj.weight",
            ),
            _linear(
                lambda m: m.blocks.layers.mlp.shared_gate.weight, "mlp.shared_expert_gate.weight"
            ),
        ]
    return tensors


def _layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def _hf_tensors(model: DecoderLM, tensors: list[_Tensor]) -> dict[str, Any]:
    """``{hf name: tensor}`` for ``model`` (numpy or abstract arrays, whichever it holds)."""
    out: dict[str, Any] = {}
    for tensor in tensors:
        array = tensor.where(model)
        if not tensor.layered:
            out.update(tensor.to_hf(array))
            continue
        for layer in range(model.config.n_layers):
            prefix = _layer_prefix(layer)
            out.update({prefix + name: value for name, value in tensor.to_hf(array[layer]).items()})
    for name in _zero_output_biases(model.config):
        out[name] = np.zeros((model.config.d_model,), model.embedding.weight.dtype)
    return out


def _zero_output_biases(config: DecoderConfig) -> list[str]:
    """Llama's ``attention_bias`` gives ``o_proj`` a bias too; the zoo has none, i.e. zeros."""
    if type(config) is not LlamaConfig or not config.qkv_bias:
        return []
    return [_layer_prefix(layer) + "self_attn.o_proj.bias" for layer in range(config.n_layers)]


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def load_hf(path: str | os.PathLike) -> DecoderLM:
    """Load a Hugging Face ``LlamaForCausalLM``, ``MixtralForCausalLM`` or
    ``Qwen2MoeForCausalLM`` checkpoint directory as a zoo `DecoderLM`.

    ``path`` holds ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json``
    and its shards). Arrays keep the checkpoint's float dtype (float32, bfloat16, ...). Each
    per-layer tensor is transposed/reshaped to the zoo layout (e.g. ``q_proj.weight
    (heads * head_dim, embed)`` -> ``wq (embed, heads, head_dim)``) and stacked on the leading
    ``layers`` axis. The model is assembled without random initialisation (abstract skeleton,
    then every array replaced), so loading a large checkpoint costs its size in memory, once.

    Raises `ConfigError` for config fields the zoo cannot represent and `HFCheckpointError`
    for missing files and missing, unexpected or mis-shaped tensors, naming each.
    """
    directory = Path(path)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise HFCheckpointError(
            f"{directory}: no {CONFIG_NAME} (expected a Hugging Face checkpoint directory)"
        )
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise HFCheckpointError(f"{config_path}: not valid JSON ({error})") from None
    config = config_from_hf(hf_config, where=str(config_path))
    tensors = _tensors(config)

    skeleton = eqx.filter_eval_shape(DecoderLM, config, key=jax.random.key(0))
    expected = eqx.filter_eval_shape(lambda model: _hf_tensors(model, tensors), skeleton)
    checkpoint = _Checkpoint(directory)
    if type(config) is MixtralConfig:
        # transformers 5 names Mixtral's block_sparse_moe "mlp" in memory (fused layout).
        checkpoint.rename(".mlp.", ".block_sparse_moe.")

    arrays = []
    for tensor in tensors:
        shape = tensor.where(skeleton).shape
        if tensor.layered:
            layers = [
                tensor.from_hf(_LayerReader(checkpoint, _layer_prefix(layer), expected), shape[1:])
                for layer in range(config.n_layers)
            ]
            arrays.append(jnp.asarray(np.stack(layers)))
        else:
            arrays.append(
                jnp.asarray(tensor.from_hf(_LayerReader(checkpoint, "", expected), shape))
            )
    for name in _zero_output_biases(config):
        if np.any(checkpoint.read(name, (config.d_model,))):
            raise HFCheckpointError(
                f"tensor {name} is non-zero: the zoo's attention has no output bias"
            )

    unused = [key for key in checkpoint.unused() if not _ignorable(key, config)]
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise HFCheckpointError(
            f"{directory}: unexpected tensor(s) {', '.join(unused[:3])}{more} for {type(config).__name__}"
        )
    model = eqx.tree_at(lambda m: [tensor.where(m) for tensor in tensors], skeleton, arrays)
    assert not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(model)), (
        "every array of the model must come from the checkpoint"
    )
    return model


def _ignorable(key: str, config: DecoderConfig) -> bool:
    """Tensors Hugging Face itself ignores: cached rotary tables, a tied head's copy."""
    return key.endswith("rotary_emb.inv_freq") or (
        config.tie_embeddings and key == "lm_head.weight"
    )


def save_hf(model: DecoderLM, path: str | os.PathLike) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory: ``config.json`` and
    ``model.safetensors`` in the Hub's canonical layout (torch ``(out, in)`` weights, one
    tensor per expert), loadable with ``transformers.AutoModelForCausalLM.from_pretrained``.

    Arrays keep their dtype, which ``config.json`` records. Raises `ConfigError` naming the
    field if the model's config has no exact Hugging Face counterpart (a norm other than
    RMSNorm, GELU, QK-norm, Mixtral without renormalised top-k, ...).
    """
    safetensors = _import_safetensors()
    config = model.config
    tensors = _tensors(config)
    dtype = np.dtype(model.embedding.weight.dtype).name
    hf_config = config_to_hf(config, dtype)
    host_model = jax.tree.map(np.asarray, model)
    hf_tensors = {
        name: np.ascontiguousarray(value)
        for name, value in _hf_tensors(host_model, tensors).items()
    }

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    safetensors.numpy.save_file(
        hf_tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"}
    )
