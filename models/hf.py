"""Hugging Face checkpoints: read and write ``config.json`` plus safetensors for any family
in `models.registry` that has a Hugging Face mapping.

    model = load_hf("path/to/hf-checkpoint")   # config.json + model.safetensors (or shards)
    save_hf(model, "path/to/out")              # loads with AutoModelForCausalLM.from_pretrained

This module is generic: which family a ``config.json`` is, which of its keys mean what, and
how each tensor is named and laid out all come from the family's file (`models.family`).
Only files are read and written: neither transformers nor torch is imported.
``safetensors`` (for writing) comes with the ``hf`` extra.

Reading is lazy (`open_hf`): the result is the zoo model whose arrays are
`models.tensor_files.LazyArray` views of the stored tensors, so a trainer reads only the
slices its devices hold (`eqxzoo.train.state.init_train_state_from`) and `load_hf` reads
everything. Writing (`write_hf`) takes a model whose arrays are anything read by slices and
reads one layer's tensor at a time, writing shard by shard.

Layouts. Hugging Face stores a linear layer's weight output-major ``(out, in)``; the zoo keeps
``(in, out)`` and per-head attention weights (``wq: (embed, heads, head_dim)``), so every
tensor is transposed and reshaped on the way in and out; per-layer tensors are stacked on the
zoo's leading ``layers`` axis. Expert weights are read in either of the two layouts found in
the wild (one tensor per expert, or transformers 5's fused ``gate_up_proj``/``down_proj``);
`save_hf` writes the Hub's one tensor per expert. Anything the zoo cannot represent exactly
is refused with one line naming the field or tensor, never approximated.
"""

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqxzoo.nn.lora import LoraWeight
from eqxzoo.typed_config import build_dataclass, dataclass_to_table, flatten, refuse
from models.config import RUNTIME_KEYS, ConfigError, DecoderConfig
from models.decoder import DecoderLM
from models.family import HFConfig, HFMapping, Tensor, tensor_parts
from models.registry import families, family_for_hf, family_of
from models.tensor_files import (
    DEFAULT_MAX_SHARD_BYTES,
    HFCheckpointError,
    SafetensorsFiles,
    Sliceable,
    stack,
    write_safetensors,
)

__all__ = [
    "CONFIG_NAME",
    "HFCheckpoint",
    "HFCheckpointError",
    "config_from_hf",
    "config_to_hf",
    "config_with_hf",
    "load_hf",
    "open_hf",
    "read_hf_config",
    "save_hf",
    "write_hf",
]

CONFIG_NAME = "config.json"


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
    try:
        mapping.check_keys(reader)
        return mapping.config_from_hf(reader)
    except ConfigError as error:
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
# Reading
# --------------------------------------------------------------------------------------------


def read_hf_config(path: str | os.PathLike) -> DecoderConfig:
    """The zoo config of the Hugging Face checkpoint directory ``path`` (its ``config.json``
    only; no tensor is read). `HFCheckpointError` if the file is missing or not JSON,
    `ConfigError` naming the key for what the zoo cannot represent."""
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise HFCheckpointError(
            f"{Path(path)}: no {CONFIG_NAME} (expected a Hugging Face checkpoint directory)"
        )
    try:
        hf_config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HFCheckpointError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(hf_config, dict):
        raise HFCheckpointError(f"{config_path}: not a JSON object")
    return config_from_hf(hf_config, where=str(config_path))


def config_with_hf(table: Mapping[str, Any], directory: str, *, where: str) -> DecoderConfig:
    """The config of the checkpoint at ``directory`` with ``table``'s run-time keys
    (`RUNTIME_KEYS`: ``remat``, ``scan_layers``, MoE routing) applied: a ``[model]`` table
    with ``init_from_hf``. Any other key of ``table`` must agree with the checkpoint's
    ``config.json``; `ConfigError` naming ``where.key`` and both values if it does not."""
    try:
        from_hf = read_hf_config(Path(directory).expanduser())
    except HFCheckpointError as error:
        refuse(f"{where}.init_from_hf", str(error))
    config_json = Path(directory) / CONFIG_NAME
    family = table.get("family", from_hf.family)
    if family != from_hf.family:
        refuse(
            f"{where}.family",
            f"{family!r} here but {config_json} is family {from_hf.family!r}; remove the key",
        )
    checkpoint_table = dataclass_to_table(from_hf)
    given = {key: value for key, value in table.items() if key != "family"}
    merged = {**checkpoint_table, **given}
    if isinstance(given.get("moe"), Mapping) and isinstance(checkpoint_table.get("moe"), Mapping):
        merged["moe"] = {**checkpoint_table["moe"], **given["moe"]}
    expected = flatten(checkpoint_table)

    def refuse_disagreement(got: Mapping[str, Any]) -> None:
        for key in sorted(got):
            if key not in RUNTIME_KEYS and expected.get(key) != got[key]:
                refuse(
                    f"{where}.{key}",
                    f"{got[key]!r} here but {expected.get(key)!r} in {config_json} "
                    "(init_from_hf fixes the architecture); remove the key or make it agree",
                )

    try:
        config = build_dataclass(type(from_hf), merged, where)
    except ConfigError:
        refuse_disagreement(flatten(given))  # the cause, if a given key disagrees
        raise
    built = flatten(dataclass_to_table(config))
    refuse_disagreement({key: built.get(key) for key in built.keys() | expected.keys()})
    return config


class _LayerReader:
    """Reads one layer's (or the model's top-level) tensors by name relative to ``prefix``,
    lazily, after checking dtype and shape; records which stored tensors were asked for.

    Shapes are checked against ``expected`` (what `write_hf` would write for the config)
    unless the caller gives one.
    """

    def __init__(
        self,
        files: SafetensorsFiles,
        stored_names: Mapping[str, str],
        prefix: str,
        expected: Mapping[str, Any],
        used: set[str],
    ):
        self.files, self.stored_names, self.prefix = files, stored_names, prefix
        self.expected, self.used = expected, used

    def has(self, name: str) -> bool:
        return self.prefix + name in self.stored_names

    def __call__(self, name: str, shape: tuple[int, ...] | None = None) -> Sliceable:
        key = self.prefix + name
        if shape is None and key in self.expected:
            shape = tuple(self.expected[key].shape)
        stored = self.stored_names.get(key, key)
        tensor = self.files.tensor(stored)
        if not jnp.issubdtype(tensor.dtype, jnp.floating):
            raise HFCheckpointError(
                f"tensor {stored} has dtype {tensor.dtype}; expected a float tensor"
            )
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise HFCheckpointError(
                f"tensor {stored} has shape {tuple(tensor.shape)}; expected {tuple(shape)}"
            )
        self.used.add(stored)
        return tensor


@dataclasses.dataclass
class HFCheckpoint:
    """A Hugging Face checkpoint opened for lazy reading.

    ``model`` is the zoo model (plain layout: blocks stacked on a leading ``layers`` axis)
    whose arrays are lazy `Sliceable` views of the stored tensors in the zoo's layout and the
    checkpoint's dtypes: indexing one reads only what the index covers. ``files.bytes_read``
    counts what has been read.
    """

    directory: Path
    config: DecoderConfig
    model: DecoderLM
    files: SafetensorsFiles


def open_hf(path: str | os.PathLike) -> HFCheckpoint:
    """Open the Hugging Face checkpoint directory ``path`` of any registered family.

    Reads ``config.json`` and the safetensors headers, and checks every tensor's presence,
    dtype and shape and that no tensor is left over (`HFCheckpointError` naming it); no
    tensor data is read except the few that must be zero (Llama's ``o_proj`` bias).
    """
    directory = Path(path)
    config = read_hf_config(directory)
    mapping = hf_mapping(config)
    tensors: list[Tensor] = mapping.tensors(config)
    skeleton = _skeleton(config)
    expected = {
        name: value
        for producer in _producers(config, mapping)
        for name, value in _produce(producer, skeleton, np.dtype(np.float32), config).items()
    }
    files = SafetensorsFiles(directory)
    stored_names = {}
    for stored in files.names():
        read_as = stored
        for old, new in mapping.renames:
            read_as = read_as.replace(old, new)
        stored_names[read_as] = stored
    used: set[str] = set()

    def reader(prefix: str) -> _LayerReader:
        return _LayerReader(files, stored_names, prefix, expected, used)

    arrays = []
    for tensor in tensors:
        shapes = [part.shape for part in tensor_parts(tensor.where(skeleton))]
        if tensor.layered:
            per_layer = [shape[1:] for shape in shapes]
            layers = [
                tensor_parts(tensor.from_hf(reader(mapping.layer_prefix(layer)), _like(per_layer)))
                for layer in tensor.layers(config)
            ]
            arrays += [stack(list(part_layers)) for part_layers in zip(*layers, strict=True)]
        else:
            arrays += tensor_parts(tensor.from_hf(reader(""), _like(shapes)))
    for name in mapping.zero_tensors(config):
        if np.any(np.asarray(reader("")(name, (config.d_model,)))):
            raise HFCheckpointError(
                f"tensor {name} is non-zero: the zoo's attention has no output bias"
            )
    unused = [
        name for name in files.names() if name not in used and not _ignorable(name, config, mapping)
    ]
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise HFCheckpointError(
            f"{directory}: unexpected tensor(s) {', '.join(unused[:3])}{more} "
            f"for {type(config).__name__}"
        )

    def stored_arrays(model):
        return [part for tensor in tensors for part in tensor_parts(tensor.where(model))]

    for goal, array in zip(stored_arrays(skeleton), arrays, strict=True):
        assert tuple(array.shape) == tuple(goal.shape), (goal, array.shape)
    model = eqx.combine(
        per_layer_data(type(skeleton), config), eqx.tree_at(stored_arrays, skeleton, arrays)
    )
    assert not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(model)), (
        "every array of the model must come from the checkpoint"
    )
    return HFCheckpoint(directory, config, model, files)


def load_hf(path: str | os.PathLike) -> DecoderLM:
    """Load a Hugging Face checkpoint directory of any registered family as a zoo `DecoderLM`.

    ``path`` holds ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json``
    and its shards). Arrays keep the checkpoint's float dtype (float32, bfloat16, ...). Each
    per-layer tensor is transposed/reshaped to the zoo layout (e.g. ``q_proj.weight
    (heads * head_dim, embed)`` -> ``wq (embed, heads, head_dim)``) and stacked on the leading
    ``layers`` axis. The model is assembled without random initialisation (`open_hf`, then
    every array read once).

    Raises `ConfigError` for config fields the zoo cannot represent and `HFCheckpointError`
    for missing files and missing, unexpected or mis-shaped tensors, naming each.
    """
    checkpoint = open_hf(path)
    return jax.tree.map(lambda lazy: jnp.asarray(np.asarray(lazy)), checkpoint.model)


def _ignorable(key: str, config: DecoderConfig, mapping: HFMapping) -> bool:
    """Tensors Hugging Face itself ignores: cached rotary tables and masks, a tied head's copy."""
    return (
        key.endswith("rotary_emb.inv_freq")
        or key.endswith(mapping.ignored_tensor_suffixes)
        or (config.tie_embeddings and key == "lm_head.weight")
    )


def _like(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
    """One shape, or a tuple of them for a tensor made of several zoo arrays."""
    return shapes[0] if len(shapes) == 1 else tuple(shapes)


def _skeleton(config: DecoderConfig) -> Any:
    """The model of ``config``'s family as shape structs (nothing computed)."""
    return eqx.filter_eval_shape(family_of(config).model_class, config, key=jax.random.key(0))


def per_layer_data(model_class: type, config: DecoderConfig) -> Any:
    """The integer arrays of ``model_class(config)`` (per-layer data such as sliding windows)
    as numpy arrays, every other leaf None: what no checkpoint stores, since the config
    fixes it. The constructor runs under `jax.jit` with only these as outputs, so XLA
    drops the weights' initialisation: nothing of the model's size is computed."""

    def is_data(leaf) -> bool:
        return eqx.is_array(leaf) and not eqx.is_inexact_array(leaf)

    data = eqx.filter_jit(lambda: eqx.filter(model_class(config, key=jax.random.key(0)), is_data))()
    return jax.tree.map(np.asarray, data)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _producers(config: DecoderConfig, mapping: HFMapping) -> list[tuple[Tensor | str, int | None]]:
    """What makes each group of Hugging Face tensors: a `Tensor` at a layer (``None`` for the
    model's top-level arrays), or a zero tensor's name."""
    producers: list[tuple[Tensor | str, int | None]] = []
    for tensor in mapping.tensors(config):
        if tensor.layered:
            producers += [(tensor, layer) for layer in tensor.layers(config)]
        else:
            producers.append((tensor, None))
    producers += [(name, None) for name in mapping.zero_tensors(config)]
    return producers


def _produce(
    producer: tuple[Tensor | str, int | None], model: Any, dtype: np.dtype, config: DecoderConfig
) -> dict[str, Any]:
    """``{hf name: tensor}`` of one producer, reading one layer of the model's array (numpy
    for sliceable arrays, abstract for shape structs)."""
    tensor, layer = producer
    if isinstance(tensor, str):
        return {tensor: np.zeros((config.d_model,), dtype)}
    parts = []
    for array in tensor_parts(tensor.where(model)):
        if isinstance(array, jax.ShapeDtypeStruct):
            shape = array.shape if layer is None else array.shape[1:]
            parts.append(jax.ShapeDtypeStruct(shape, dtype))
        else:
            stacked = None if layer is None else layer - tensor.layers(config).start
            index = () if layer is None else (slice(stacked, stacked + 1),)
            values = np.asarray(array[index]).astype(dtype)
            parts.append(values if layer is None else values[0])
    whole = parts[0] if len(parts) == 1 else tuple(parts)
    if isinstance(parts[0], jax.ShapeDtypeStruct):
        made = jax.eval_shape(tensor.to_hf, whole)
    else:
        made = tensor.to_hf(whole)
    prefix = "" if layer is None else hf_mapping(config).layer_prefix(layer)
    return {prefix + name: value for name, value in made.items()}


def write_hf(
    model: Any,
    path: str | os.PathLike,
    *,
    dtype: str | np.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    process_index: int = 0,
    process_count: int = 1,
    write_config: bool = True,
) -> None:
    """Write ``model`` (a zoo model whose arrays are `Sliceable`: numpy or JAX arrays, or lazy
    readers of a checkpoint) as a Hugging Face checkpoint directory in ``dtype``:
    ``config.json`` (unless not ``write_config``: `pipelines.export` writes its own) and
    safetensors in the Hub's canonical layout (torch ``(out, in)`` weights, one tensor per
    expert), sharded when larger than ``max_shard_bytes``.

    One layer of one array is read at a time and one shard is held in memory at a time;
    with ``process_count > 1`` each process writes every ``process_count``-th shard and
    process 0 the config and index. Raises `ConfigError` naming the field if the model's
    config has no exact Hugging Face counterpart.
    """
    config = model.config
    mapping = hf_mapping(config)
    dtype = np.dtype(dtype)
    hf_config = config_to_hf(config, dtype.name)
    skeleton = _skeleton(config)
    producers = _producers(config, mapping)
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    made_by: dict[str, int] = {}
    for number, producer in enumerate(producers):
        for name, value in _produce(producer, skeleton, dtype, config).items():
            shapes[name] = (tuple(value.shape), dtype)
            made_by[name] = number

    def produce(names: Sequence[str]) -> dict[str, np.ndarray]:
        tensors: dict[str, np.ndarray] = {}
        for number in sorted({made_by[name] for name in names}):
            made = _produce(producers[number], model, dtype, config)
            tensors.update({name: np.asarray(made[name]) for name in made if name in names})
        return tensors

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    if process_index == 0 and write_config:
        (directory / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    write_safetensors(
        directory,
        shapes,
        produce,
        max_shard_bytes=max_shard_bytes,
        process_index=process_index,
        process_count=process_count,
    )


def save_hf(
    model: DecoderLM, path: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory (`write_hf`) in its own dtype:
    loadable with ``transformers.AutoModelForCausalLM.from_pretrained``.

    Raises `ConfigError` naming the field if the model's config has no exact Hugging Face
    counterpart (a norm other than RMSNorm, GELU, QK-norm, Mixtral without renormalised
    top-k, ...).
    """
    dtype = np.dtype(model.embedding.weight.dtype)
    write_hf(model, path, dtype=dtype, max_shard_bytes=max_shard_bytes)


PEFT_PREFIX = "base_model.model."


def peft_adapters(model: Any) -> tuple[dict[str, np.ndarray], list[str]]:
    """The LoRA adapters of ``model`` (`eqxzoo.nn.lora.LoraWeight`s; arrays numpy or lazy
    readers) in PEFT's layout: ``{base_model.model.<module>.lora_A.weight: (rank, in),
    ...lora_B.weight: (out, rank)}`` with ``lora_B @ lora_A`` the torch module's weight
    update (times ``alpha / rank``, as PEFT scales it), and the modules' short names (PEFT's
    ``target_modules``). Each adapter takes its weight's own Hugging Face layout
    (transposes and head reshapes), checked on the first layer against its merged update;
    a projection stored fused with others (GPT-2's ``c_attn``) has no PEFT counterpart and is
    refused (export the merged model instead)."""
    config = model.config
    mapping = hf_mapping(config)
    tensors: dict[str, np.ndarray] = {}
    modules: set[str] = set()
    for tensor in mapping.tensors(config):
        picked = tensor.where(model)
        parts = tensor_parts(picked)
        if not any(isinstance(part, LoraWeight) for part in parts):
            continue
        if len(parts) > 1 or not tensor.layered:
            raise ConfigError(
                "has adapters on a projection Hugging Face stores fused with others: PEFT "
                "cannot load them; export the merged model (without --adapter)",
                field="lora.targets",
            )
        adapter = picked
        lora_a, lora_b = (np.asarray(x[()]) for x in (adapter.lora_a, adapter.lora_b))
        for index, layer in enumerate(tensor.layers(config)):
            ((name, update_a),) = tensor.to_hf(lora_a[index]).items()
            ((_, update_b),) = tensor.to_hf(lora_b[index]).items()
            if index == 0:
                delta = LoraWeight(
                    np.zeros(adapter.base.shape[1:], np.float32),
                    lora_a[index],
                    lora_b[index],
                    1.0,
                    adapter.n_in,
                    adapter.axes,
                ).merged()
                ((_, expected),) = tensor.to_hf(np.asarray(delta)).items()
                if not np.allclose(update_b @ update_a, expected, rtol=1e-4, atol=1e-6):
                    raise ConfigError(
                        f"has adapters on {name}, whose Hugging Face layout reorders its "
                        "weight: PEFT cannot load them; export the merged model (without "
                        "--adapter)",
                        field="lora.targets",
                    )
            module = mapping.layer_prefix(layer) + name.removesuffix(".weight")
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(update_a)
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(update_b)
            modules.add(module.rsplit(".", 1)[-1])
    return tensors, sorted(modules)
