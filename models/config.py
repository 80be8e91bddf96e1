"""Model configs: frozen dataclasses, validated on construction, loadable from a TOML table.

`DecoderConfig` holds every knob of the shared decoder builder; each family
(`LlamaConfig`, `MixtralConfig`, `QwenMoeConfig`) is that config with the family's defaults
and the checks that keep it faithful to the architecture it names (and to its Hugging Face
layout). ``config_from_table({"family": "mixtral", ...})`` builds one from a TOML table.
"""

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from eqxzoo.nn import Activation, RematPolicy, RoutingMode


class ConfigError(ValueError):
    """A config value a user set is invalid; the message names the field and the fix."""


def _fail(field: str, problem: str) -> typing.NoReturn:
    raise ConfigError(f"{field}: {problem}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed experts (and optional shared experts) replacing every layer's MLP."""

    n_experts: int = 8
    top_k: int = 2
    expert_mlp_dim: int = 512
    normalize_topk: bool = True
    shared_mlp_dim: int = 0
    shared_gate: bool = False
    routing: RoutingMode = "dropless"
    capacity_factor: float = 1.25

    def __post_init__(self):
        if self.n_experts < 1:
            _fail("n_experts", f"must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            _fail("top_k", f"must be between 1 and n_experts={self.n_experts}, got {self.top_k}")
        if self.expert_mlp_dim < 1:
            _fail("expert_mlp_dim", f"must be >= 1, got {self.expert_mlp_dim}")
        if self.shared_mlp_dim < 0:
            _fail(
                "shared_mlp_dim", f"must be >= 0 (0: no shared experts), got {self.shared_mlp_dim}"
            )
        if self.shared_gate and self.shared_mlp_dim == 0:
            _fail("shared_gate", "needs shared experts: set shared_mlp_dim > 0")
        if self.routing not in ("dropless", "capacity", "dense"):
            _fail("routing", f"must be 'dropless', 'capacity' or 'dense', got {self.routing!r}")
        if self.capacity_factor <= 0:
            _fail("capacity_factor", f"must be > 0, got {self.capacity_factor}")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A pre-norm decoder-only transformer LM.

    ``head_dim`` defaults to ``d_model // n_heads`` and ``n_kv_heads`` to ``n_heads`` (MHA).
    ``moe`` set: every layer's MLP is a MoE (``mlp_dim`` is then unused).
    ``scan_layers`` and ``remat`` change how the layers run, never the parameters.
    """

    family: ClassVar[str] = "decoder"

    vocab_size: int = 32000
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_dim: int = 1408
    activation: Activation = "swiglu"
    norm: Literal["rms", "layer"] = "rms"
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe: MoEConfig | None = None
    scan_layers: bool = True
    remat: RematPolicy = "none"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_dim"):
            if getattr(self, name) < 1:
                _fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.kv_heads != 0:
            _fail("n_kv_heads", f"must divide n_heads={self.n_heads}, got {self.kv_heads}")
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            _fail(
                "head_dim",
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: set head_dim",
            )
        if self.attention_head_dim % 2 != 0:
            _fail("head_dim", f"must be even for rotary embeddings, got {self.attention_head_dim}")
        if self.activation not in ("swiglu", "gelu"):
            _fail("activation", f"must be 'swiglu' or 'gelu', got {self.activation!r}")
        if self.norm not in ("rms", "layer"):
            _fail("norm", f"must be 'rms' or 'layer', got {self.norm!r}")
        if self.remat not in ("none", "full", "dots"):
            _fail("remat", f"must be 'none', 'full' or 'dots', got {self.remat!r}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def attention_head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Dense Llama: RMSNorm, RoPE, GQA, SwiGLU, optional tied embeddings."""

    family: ClassVar[str] = "llama"

    def __post_init__(self):
        super().__post_init__()
        if self.moe is not None:
            _fail("moe", "llama is dense: use family 'mixtral' or 'qwen_moe' for experts")


@dataclasses.dataclass(frozen=True)
class MixtralConfig(DecoderConfig):
    """Mixtral: Llama with every MLP a top-k MoE of SwiGLU experts, no shared experts."""

    family: ClassVar[str] = "mixtral"
    moe: MoEConfig | None = MoEConfig()

    def __post_init__(self):
        super().__post_init__()
        if self.moe is None:
            _fail("moe", "mixtral needs a [moe] table")
        if self.moe.shared_mlp_dim:
            _fail("moe.shared_mlp_dim", "mixtral has no shared experts: use family 'qwen_moe'")


@dataclasses.dataclass(frozen=True)
class QwenMoeConfig(DecoderConfig):
    """Qwen2-MoE: q/k/v biases, top-k experts plus a sigmoid-gated shared expert."""

    family: ClassVar[str] = "qwen_moe"
    qkv_bias: bool = True
    moe: MoEConfig | None = MoEConfig(normalize_topk=False, shared_mlp_dim=1024, shared_gate=True)

    def __post_init__(self):
        super().__post_init__()
        if self.moe is None:
            _fail("moe", "qwen_moe needs a [moe] table")


FAMILIES: dict[str, type[DecoderConfig]] = {
    cls.family: cls for cls in (DecoderConfig, LlamaConfig, MixtralConfig, QwenMoeConfig)
}


def config_from_table(table: Mapping[str, Any], *, where: str = "model") -> DecoderConfig:
    """Build a family config from a TOML table such as ``[model]`` (with a ``[model.moe]``).

    ``family`` picks the class (default ``"decoder"``); unknown keys and wrongly typed values
    raise `ConfigError` naming the key as ``where.key``.
    """
    table = dict(table)
    family = table.pop("family", "decoder")
    if family not in FAMILIES:
        _fail(f"{where}.family", f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    cls = FAMILIES[family]
    if "moe" in table:
        table["moe"] = build_dataclass(MoEConfig, table["moe"], f"{where}.moe")
    return build_dataclass(cls, table, where)


def build_dataclass(cls: type, table: Any, where: str):
    """``cls(**table)`` for a dataclass ``cls``, with every key and value checked first.

    Unknown keys, values that do not match a field's annotation (``int``, ``float``, ``str``,
    ``bool``, ``Literal``, unions, ``tuple[X, ...]``) and the `ConfigError` of the class's own
    validation raise one-line `ConfigError` messages naming ``where.key``. TOML integers
    become floats for float fields and TOML arrays become tuples for tuple fields.
    """
    if not isinstance(table, Mapping):
        _fail(where, f"must be a table, got {type(table).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in table.items():
        if key not in fields:
            _fail(f"{where}.{key}", f"unknown key; valid keys are {sorted(fields)}")
        if not _matches(value, hints[key]):
            _fail(f"{where}.{key}", f"expected {_describe(hints[key])}, got {value!r}")
    table = {key: _as_declared(value, hints[key]) for key, value in table.items()}
    try:
        return cls(**table)
    except ConfigError as error:
        raise ConfigError(f"{where}.{error}") from None


def _as_declared(value: Any, hint: Any) -> Any:
    """TOML writes ``500000`` for a float field: give float fields a float (and tuple fields a tuple)."""
    item = _tuple_item(hint)
    if item is not None and isinstance(value, (list, tuple)):
        return tuple(_as_declared(element, item) for element in value)
    accepts_float = hint is float or float in typing.get_args(hint)
    accepts_int = hint is int or int in typing.get_args(hint)
    if accepts_float and not accepts_int and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
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
    return "none" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _tuple_item(hint: Any) -> Any:
    """``X`` for a ``tuple[X, ...]`` annotation, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None
