"""Typed configs: frozen dataclasses checked on construction, read from and written to TOML.

Every config a user writes (the run's sections, the model families, the mesh, the
optimizer, the sharding rules) is a frozen dataclass whose ``__post_init__`` starts with
`check_fields`: each
value must match its annotation (``int``, ``float``, ``str``, ``bool``, ``Literal``, unions,
``tuple[X, ...]``, nested config dataclasses), so a bad value is refused the same way
whether it came from Python, a TOML file or ``--set``. `build_dataclass` builds one from a
TOML table, refusing unknown keys; `read_toml` and `apply_overrides` read a file and its
command-line overrides; `dataclass_to_table` and `toml_text` write one back.

Each field declares its role once, with `architecture_field`, `identity_field` or
`runtime_field`: whether it is part of what the model computes, part of what the run is,
or a choice of how the same run is carried out (which a resume may change); `keys_with_role`
derives the lists (runtime model keys, resumable run keys) from those declarations.

Every message is one line naming the key (``mesh.dp: expected int, got 'two'``), raised as
`ConfigError`. This module imports no JAX: commands check a config before starting it.
"""

import copy
import dataclasses
import functools
import json
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from eqxzoo.errors import ConfigError

__all__ = [
    "ConfigError",
    "FieldRole",
    "architecture_field",
    "field_role",
    "identity_field",
    "keys_with_role",
    "runtime_field",
    "apply_overrides",
    "build_dataclass",
    "check_fields",
    "dataclass_to_table",
    "refuse",
    "parse_override_value",
    "read_toml",
    "require_at_least",
    "toml_text",
]


FieldRole = Literal["architecture", "identity", "runtime"]
_ROLE = "eqxzoo.role"
_OFF_AT_ZERO = "eqxzoo.off_at_zero"


def _role_field(role: FieldRole, default: Any, off_at_zero: bool = False) -> Any:
    return dataclasses.field(default=default, metadata={_ROLE: role, _OFF_AT_ZERO: off_at_zero})


def architecture_field(default: Any) -> Any:
    """A field that is part of what the model computes (shapes, layout, numerics): a Hugging
    Face config states it or the family fixes it, and a resume may never change it."""
    return _role_field("architecture", default)


def identity_field(default: Any) -> Any:
    """A field that is part of what a run is without being the model's (the data and its
    order, the seeds, the optimizer and its state, the parameters' dtype): a resume may
    never change it."""
    return _role_field("identity", default)


def runtime_field(default: Any, *, off_at_zero: bool = False) -> Any:
    """A field that chooses how the same run is carried out (mesh, schedule, batch shape,
    remat, kernels, logging, learning-rate schedule, ...): a resume may change it.
    ``off_at_zero``: 0 turns a transformation off, and with it its optimizer state, so a
    resume may not move it to or from 0."""
    return _role_field("runtime", default, off_at_zero)


def field_role(cls: type, name: str) -> tuple[FieldRole, bool] | None:
    """``(role, off_at_zero)`` that the dataclass ``cls`` or the nearest base declaring its
    field ``name`` gives it (a subclass that only changes a default keeps the base's role);
    None when none does."""
    for base in cls.__mro__:
        field = getattr(base, "__dataclass_fields__", {}).get(name)
        if field is not None and _ROLE in field.metadata:
            return field.metadata[_ROLE], field.metadata[_OFF_AT_ZERO]
    return None


def config_leaves(cls: type, prefix: str = "") -> dict[str, tuple[type, str]]:
    """Every leaf field of the config dataclass ``cls`` by dotted key, with the dataclass
    that declares it. A field typed as a config dataclass (``X`` or ``X | None``) is a
    section, walked into, unless it declares a role itself (``rope_scaling``: its keys are
    one leaf, of that role)."""
    leaves = {}
    for name, hint in _field_hints(cls).items():
        section = _dataclass_in(hint)
        if section is not None and field_role(cls, name) is None:
            leaves.update(config_leaves(section, f"{prefix}{name}."))
        else:
            leaves[f"{prefix}{name}"] = (cls, name)
    return leaves


def keys_with_role(
    cls: type, role: FieldRole, *, off_at_zero: bool | None = None
) -> tuple[str, ...]:
    """The dotted keys of ``cls``'s leaf fields declared with ``role`` (and, when given,
    ``off_at_zero``), in declaration order."""
    keys = []
    for key, (holder, name) in config_leaves(cls).items():
        declared = field_role(holder, name)
        if declared is not None and declared[0] == role:
            if off_at_zero is None or declared[1] == off_at_zero:
                keys.append(key)
    return tuple(keys)


def refuse(key: str, problem: str) -> typing.NoReturn:
    """Raise ``ConfigError(problem, field=key)`` (``"key: problem"``): the config refuses a
    value (commands report it through `eqxzoo.errors.run_command`)."""
    raise ConfigError(problem, field=key)


def require_at_least(config: Any, minimum: int | float, *names: str) -> None:
    """Each named field of ``config`` must be ``>= minimum``."""
    for name in names:
        value = getattr(config, name)
        if value < minimum:
            refuse(name, f"must be >= {minimum}, got {value}")


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    return {
        name: hint
        for name, hint in typing.get_type_hints(cls).items()
        if name in {field.name for field in dataclasses.fields(cls)}
    }


def check_fields(config: Any) -> None:
    """Check every field of the dataclass instance ``config`` against its annotation.

    Call first in ``__post_init__``. Integers given for float-only fields become floats and
    lists given for tuple fields become tuples (TOML writes ``500000`` and ``[...]``), so a
    config equals itself after a trip through TOML.
    """
    for name, hint in _field_hints(type(config)).items():
        value = getattr(config, name)
        _check_value(name, value, hint)
        declared = _as_declared(value, hint)
        if declared is not value:
            object.__setattr__(config, name, declared)


def build_dataclass(cls: type, table: Any, where: str) -> Any:
    """``cls(**table)`` for a config dataclass ``cls``; messages name ``where.key``.

    Unknown keys are refused with the list of valid ones; a sub-table for a field whose
    annotation names a config dataclass (``moe: MoEConfig | None``) is built recursively.
    Values are checked and converted before the constructor sees them (as `check_fields`
    does after), so a type-checked constructor never receives a TOML integer for a float.
    """
    if not isinstance(table, Mapping):
        refuse(where, f"must be a table, got {type(table).__name__}")
    hints = _field_hints(cls)
    values = {}
    for key, value in table.items():
        if key not in hints:
            refuse(f"{where}.{key}", f"unknown key; valid keys are {sorted(hints)}")
        nested = _dataclass_in(hints[key])
        if nested is not None and isinstance(value, Mapping):
            value = build_dataclass(nested, value, f"{where}.{key}")
        elif nested is not None and not isinstance(value, (nested, type(None))):
            refuse(f"{where}.{key}", f"must be a table, got {type(value).__name__}")
        _check_value(f"{where}.{key}", value, hints[key])
        values[key] = _as_declared(value, hints[key])
    try:
        return cls(**values)
    except ConfigError as error:
        raise error.under(where) from None


def _check_value(key: str, value: Any, hint: Any) -> None:
    if not _matches(value, hint):
        refuse(key, f"expected {_describe(hint)}, got {value!r}")
    numbers = value if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(number, float) and not math.isfinite(number) for number in numbers):
        refuse(key, f"must be a finite number, got {value}")


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass named by ``hint`` (``X`` or ``X | None``), if any."""
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _as_declared(value: Any, hint: Any) -> Any:
    item = _tuple_item(hint)
    if item is None and isinstance(value, (list, tuple)):  # ``tuple[X, ...] | None``
        item = next(filter(None, map(_tuple_item, typing.get_args(hint))), None)
    if item is not None and isinstance(value, (list, tuple)):
        converted = tuple(_as_declared(element, item) for element in value)
        return value if converted == value and isinstance(value, tuple) else converted
    accepts_float = hint is float or float in typing.get_args(hint)
    accepts_int = hint is int or int in typing.get_args(hint)
    if accepts_float and not accepts_int and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return any(
            value == option and type(value) is type(option) for option in typing.get_args(hint)
        )
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    item = _tuple_item(hint)
    if item is not None:
        return isinstance(value, (list, tuple)) and all(
            _matches(element, item) for element in value
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    item = _tuple_item(hint)
    if item is not None:
        return f"a list of {_describe(item)}"
    if dataclasses.is_dataclass(hint):
        return "a table"
    return "none" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _tuple_item(hint: Any) -> Any:
    """``X`` for a ``tuple[X, ...]`` annotation, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


# ----------------------------------------------------------------------------- reading


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed TOML file; a missing, unreadable or malformed file is a one-line `ConfigError`."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a TOML config file")
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid TOML: the file is not UTF-8 text") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config file: {error.strerror}") from None


def parse_override_value(text: str) -> Any:
    """A ``--set`` value: a TOML value (``4``, ``3e-4``, ``true``, ``"x"``, ``[1, 2]``), else the text itself."""
    text = text.strip()
    if "\n" not in text:
        try:
            return tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            pass
    return text


def apply_overrides(document: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``document`` with each ``section.key[.key...]=value`` set, in order.

    Tables along the way are created when missing (``model.moe.n_experts=8`` on a config
    without ``[model.moe]``); the keys themselves are checked when the config is built.
    """
    document = copy.deepcopy(dict(document))
    for override in overrides:
        dotted, equals, text = override.partition("=")
        parts = [part.strip() for part in dotted.split(".")]
        if not equals or not all(parts):
            raise ConfigError(f"--set {override!r}: expected section.key=value, e.g. mesh.dp=4")
        if len(parts) < 2:
            raise ConfigError(
                f"--set {override!r}: name the section too, e.g. run.{parts[0]}={text.strip()}"
            )
        table = document
        for depth, part in enumerate(parts[:-1]):
            child = table.setdefault(part, {})
            if not isinstance(child, dict):
                refuse(
                    ".".join(parts[: depth + 1]),
                    f"is {child!r}, not a table: cannot set {'.'.join(parts)}",
                )
            table = child
        table[parts[-1]] = parse_override_value(text)
    return document


# ----------------------------------------------------------------------------- writing


def flatten(document: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config document's values by dotted key (``model.moe.n_experts``), tuples as lists."""
    flat = {}
    for key, value in document.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def dataclass_to_table(config: Any) -> dict[str, Any]:
    """A config dataclass as a TOML-able table: None fields left out (they are the
    defaults), nested dataclasses as sub-tables, tuples as lists."""
    table: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            value = dataclass_to_table(value)
        elif isinstance(value, tuple):
            value = list(value)
        table[field.name] = value
    return table


def toml_text(document: Mapping[str, Mapping[str, Any]]) -> str:
    """``{section: table}`` as TOML text (sub-tables as ``[section.key]``)."""
    lines: list[str] = []

    def write_table(table: Mapping[str, Any], name: str) -> None:
        if lines:
            lines.append("")
        lines.append(f"[{name}]")
        subtables = []
        for key, value in table.items():
            if isinstance(value, Mapping):
                subtables.append((key, value))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, value in subtables:
            write_table(value, f"{name}.{key}")

    for name, table in document.items():
        write_table(table, name)
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # inf, nan and 1e-08 are TOML floats too
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {value!r} as a TOML value")
