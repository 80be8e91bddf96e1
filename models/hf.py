"""Hugging Face checkpoints: read and write ``config.json`` plus safetensors for any family
in `models.registry` that has a Hugging Face mapping.

    model = load_hf("path/to/hf-checkpoint")   # config.json + model.safetensors (or shards)
    save_hf(model, "path/to/out")              # loads with AutoModelForCausalLM.from_pretrained

This module is generic: which family a ``config.json`` is, which of its keys mean what, and
how each tensor is named and laid out all come from the family's file (`models.family`).
Only files are read and written: neither transformers nor torch is imported.
``safetensors`` comes with the ``hf`` extra.

Layouts. Hugging Face stores a linear layer's weight output-major ``(out, in)``; the zoo keeps
``(in, out)`` and per-head attention weights (``wq: (embed, heads, head_dim)``), so every
tensor is transposed and reshaped on the way in and out; per-layer tensors are stacked on the
zoo's leading ``layers`` axis. Expert weights are read in either of the two layouts found in
the wild (one tensor per expert, or transformers 5's fused ``gate_up_proj``/``down_proj``);
`save_hf` writes the Hub's one tensor per expert. Anything the zoo cannot represent exactly
is refused with one line naming the field or tensor, never approximated.
"""

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqxzoo.errors import UserError
from models.config import ConfigError, DecoderConfig
from models.decoder import DecoderLM
from models.family import HFConfig, HFMapping, Tensor, layer_prefix
from models.registry import families, family_for_hf, family_of

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


class HFCheckpointError(UserError, ValueError):
    """A Hugging Face checkpoint's files or tensors do not match what its config describes."""


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def config_from_hf(hf_config: Mapping[str, Any], *, where: str = CONFIG_NAME) -> DecoderConfig:
    """The zoo config of the family a ``config.json`` names.

    Raises `ConfigError` naming the key for anything the zoo cannot represent exactly,
    including a key the family does not handle whose value differs from Hugging Face's
    default; ``where`` (the file's path) prefixes the message.
    """
    mapping = family_for_hf(hf_config, where).hf
    reader = HFConfig(hf_config, mapping.defaults, where)
    mapping.check_keys(reader)
    try:
        return mapping.config_from_hf(reader)
    except ConfigError as error:
        if str(error).startswith(f"{where}: "):
            raise
        raise ConfigError(f"{where}: {error}") from None


def config_to_hf(config: DecoderConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` contents describing ``config`` to Hugging Face transformers.

    ``dtype`` is the parameters' dtype name (``"float32"``, ``"bfloat16"``). Raises
    `ConfigError` naming the field if the config has no exact Hugging Face counterpart.
    ``scan_layers``, ``remat``, ``moe.routing`` and ``moe.capacity_factor`` choose how the
    zoo runs the same parameters and are not saved.
    """
    mapping = hf_mapping(config)
    return {
        "architectures": [mapping.architecture],
        "model_type": mapping.model_type,
        **mapping.config_to_hf(config),
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def hf_mapping(config: DecoderConfig) -> HFMapping:
    """``config``'s family's Hugging Face mapping; `ConfigError` if it has none."""
    mapping = family_of(config).hf
    if mapping is None:
        names = sorted(f.config_class.__name__ for f in families().values() if f.hf is not None)
        raise ConfigError(
            f"family: {config.family!r} has no Hugging Face architecture; "
            f"use {', '.join(names[:-1])} or {names[-1]}"
        )
    return mapping


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
# Public API
# --------------------------------------------------------------------------------------------


def _hf_tensors(model: DecoderLM, mapping: HFMapping) -> dict[str, Any]:
    """``{hf name: tensor}`` for ``model`` (numpy or abstract arrays, whichever it holds)."""
    config = model.config
    out: dict[str, Any] = {}
    for tensor in mapping.tensors(config):
        array = tensor.where(model)
        if not tensor.layered:
            out.update(tensor.to_hf(array))
            continue
        for layer in range(config.n_layers):
            prefix = layer_prefix(layer)
            out.update({prefix + name: value for name, value in tensor.to_hf(array[layer]).items()})
    for name in mapping.zero_tensors(config):
        out[name] = np.zeros((config.d_model,), model.embedding.weight.dtype)
    return out


def load_hf(path: str | os.PathLike) -> DecoderLM:
    """Load a Hugging Face checkpoint directory of any registered family as a zoo `DecoderLM`.

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
    mapping = hf_mapping(config)
    tensors: list[Tensor] = mapping.tensors(config)

    skeleton = eqx.filter_eval_shape(DecoderLM, config, key=jax.random.key(0))
    expected = eqx.filter_eval_shape(lambda model: _hf_tensors(model, mapping), skeleton)
    checkpoint = _Checkpoint(directory)
    for stored, read_as in mapping.renames:
        checkpoint.rename(stored, read_as)

    arrays = []
    for tensor in tensors:
        shape = tensor.where(skeleton).shape
        if tensor.layered:
            layers = [
                tensor.from_hf(_LayerReader(checkpoint, layer_prefix(layer), expected), shape[1:])
                for layer in range(config.n_layers)
            ]
            arrays.append(jnp.asarray(np.stack(layers)))
        else:
            arrays.append(
                jnp.asarray(tensor.from_hf(_LayerReader(checkpoint, "", expected), shape))
            )
    for name in mapping.zero_tensors(config):
        if np.any(checkpoint.read(name, (config.d_model,))):
            raise HFCheckpointError(
                f"tensor {name} is non-zero: the zoo's attention has no output bias"
            )

    unused = [key for key in checkpoint.unused() if not _ignorable(key, config)]
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise HFCheckpointError(
            f"{directory}: unexpected tensor(s) {', '.join(unused[:3])}{more} "
            f"for {type(config).__name__}"
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
    dtype = np.dtype(model.embedding.weight.dtype).name
    hf_config = config_to_hf(config, dtype)
    host_model = jax.tree.map(np.asarray, model)
    hf_tensors = {
        name: np.ascontiguousarray(value)
        for name, value in _hf_tensors(host_model, hf_mapping(config)).items()
    }

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    safetensors.numpy.save_file(
        hf_tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"}
    )
