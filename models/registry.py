"""The registry of model families: every module of the ``models`` package that defines a
module-level ``FAMILY`` (`models.family.Family`).

It is the one place a family is looked up: by its TOML name (`config_from_table`, the
trainer's ``[model] family = ...``), by its config (`family_of`), and by the Hugging Face
architecture a ``config.json`` names (`family_for_hf`). Adding a family is adding its file.
"""

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from eqxzoo.typed_config import ConfigError, build_dataclass, refuse
from models.config import DecoderConfig
from models.family import Family


@functools.cache
def families() -> dict[str, Family]:
    """``{family name: Family}`` for every family module, in name order."""
    found: dict[str, Family] = {}
    package = Path(__file__).parent
    for module_info in sorted(pkgutil.iter_modules([str(package)]), key=lambda m: m.name):
        module = importlib.import_module(f"{__package__}.{module_info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, Family):
            assert family.name not in found, f"two families are named {family.name!r}"
            assert family.config_class.family == family.name, family
            found[family.name] = family
    return found


def family_of(config: DecoderConfig) -> Family:
    """The family ``config`` belongs to (by its class's ``family`` name)."""
    return families()[config.family]


def model_factory(config: DecoderConfig) -> Callable[..., Any]:
    """The model of ``config``'s family as the trainer builds it: ``make_model(key=key)``."""
    return functools.partial(family_of(config).model_class, config)


def hf_architectures() -> dict[str, Family]:
    """``{Hugging Face architecture: Family}`` for the families that have one."""
    return {f.hf.architecture: f for f in families().values() if f.hf is not None}


def family_for_hf(hf_config: Mapping[str, Any], where: str) -> Family:
    """The family a ``config.json`` names through ``architectures`` (or, lacking it,
    ``model_type``); `ConfigError` prefixed with ``where`` when none fits."""
    by_architecture = hf_architectures()
    supported = ", ".join(sorted(by_architecture))
    architectures = hf_config.get("architectures")
    if architectures:
        known = [name for name in architectures if name in by_architecture]
        if len(known) != 1:
            raise ConfigError(
                f"{where}: architectures: {list(architectures)} is not supported; "
                f"supported: {supported}"
            )
        family = by_architecture[known[0]]
        model_type = hf_config.get("model_type", family.hf.model_type)
        if model_type != family.hf.model_type:
            raise ConfigError(
                f"{where}: model_type: {model_type!r} does not match architecture {known[0]}"
            )
        return family
    model_type = hf_config.get("model_type")
    for family in by_architecture.values():
        if family.hf.model_type == model_type:
            return family
    raise ConfigError(
        f"{where}: architectures: missing, and model_type {model_type!r} is not supported; "
        f"supported: {supported}"
    )


def config_from_table(table: Any, *, where: str = "model") -> DecoderConfig:
    """Build a family config from a TOML table such as ``[model]`` (with a ``[model.moe]``).

    ``family`` picks the class (default ``"decoder"``); unknown keys and wrongly typed values
    raise `ConfigError` naming the key as ``where.key``.
    """
    if not isinstance(table, Mapping):
        refuse(where, f"must be a table, got {type(table).__name__}")
    table = dict(table)
    name = table.pop("family", "decoder")
    known = families()
    if name not in known:
        refuse(f"{where}.family", f"unknown family {name!r}; choose one of {sorted(known)}")
    return build_dataclass(known[name].config_class, table, where)


# The shapes every tiny example shares (a family's `Family.tiny` adds what makes it that family).
TINY_SHAPES = dict(vocab_size=53, d_model=32, n_heads=4, n_kv_heads=2, mlp_dim=48)


def tiny_config(family: str, *, n_layers: int = 2, **fields: Any) -> DecoderConfig:
    """A tiny example of ``family`` with ``n_layers`` pipelined blocks (after any dense prefix
    layers), for tests and examples: `TINY_SHAPES`, the family's `Family.tiny`, then
    ``fields``."""
    chosen = {**TINY_SHAPES, **families()[family].tiny, **fields}
    chosen["n_layers"] = n_layers + chosen.get("first_dense_layers", 0)
    if chosen.get("layer_types") is not None:
        chosen["layer_types"] = tuple(chosen["layer_types"])[: chosen["n_layers"]]
    return families()[family].config_class(**chosen)
