"""The shared decoder builder's config: frozen dataclasses, validated on construction.

`DecoderConfig` holds every knob of the shared decoder builder (`models.decoder`); each
family (``models/llama.py``, ``models/mixtral.py``, ...) subclasses it with the family's
defaults and the checks that keep it faithful to the architecture it names. Values are
checked against their annotations first (`eqxzoo.typed_config.check_fields`), so a bad
``routing`` or ``remat`` is refused the same way from Python, TOML or ``--set``.
"""

import dataclasses
from typing import ClassVar, Literal

from eqxzoo.nn import Activation, RematPolicy, RoutingMode
from eqxzoo.typed_config import ConfigError, check_fields, refuse, require_at_least

__all__ = ["RUNTIME_KEYS", "ConfigError", "DecoderConfig", "MoEConfig"]

# Keys that choose how the zoo runs the same parameters, never what they compute.
RUNTIME_KEYS = ("scan_layers", "remat", "moe.routing", "moe.capacity_factor")


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
        check_fields(self)
        require_at_least(self, 1, "n_experts", "expert_mlp_dim")
        if not 1 <= self.top_k <= self.n_experts:
            refuse("top_k", f"must be between 1 and n_experts={self.n_experts}, got {self.top_k}")
        if self.shared_mlp_dim < 0:
            refuse(
                "shared_mlp_dim", f"must be >= 0 (0: no shared experts), got {self.shared_mlp_dim}"
            )
        if self.shared_gate and self.shared_mlp_dim == 0:
            refuse("shared_gate", "needs shared experts: set shared_mlp_dim > 0")
        if self.capacity_factor <= 0:
            refuse("capacity_factor", f"must be > 0, got {self.capacity_factor}")


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
        check_fields(self)
        require_at_least(self, 1, "vocab_size", "d_model", "n_layers", "n_heads", "mlp_dim")
        if self.kv_heads < 1:
            refuse("n_kv_heads", f"must be >= 1, got {self.kv_heads}")
        if self.n_heads % self.kv_heads != 0:
            refuse("n_kv_heads", f"must divide n_heads={self.n_heads}, got {self.kv_heads}")
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            refuse(
                "head_dim",
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: set head_dim",
            )
        if self.attention_head_dim % 2 != 0:
            refuse("head_dim", f"must be even for rotary embeddings, got {self.attention_head_dim}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def attention_head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim
