"""The shared decoder builder's config: frozen dataclasses, validated on construction.

`DecoderConfig` holds every knob of the shared decoder builder (`models.decoder`); each
family (``models/llama.py``, ``models/mixtral.py``, ...) subclasses it with the family's
defaults and the checks that keep it faithful to the architecture it names. Values are
checked against their annotations first (`eqxzoo.typed_config.check_fields`), so a bad
``routing`` or ``remat`` is refused the same way from Python, TOML or ``--set``.
"""

import dataclasses
from typing import Any, ClassVar, Literal

import jax.numpy as jnp

from eqxzoo.nn import (
    Activation,
    ExpertActivation,
    RematPolicy,
    RopeScaling,
    RoutingMode,
    Scoring,
)
from eqxzoo.nn.attention import check_kv_heads
from eqxzoo.nn.context import ContextSplit, ContextStrategy
from eqxzoo.nn.expert_parallel import ExpertSplit
from eqxzoo.nn.experts import DroplessKernel
from eqxzoo.nn.kernels import DEFAULT_BLOCK_SIZE, AttentionKernel, cudnn_supports
from eqxzoo.nn.lora import adaptable_names
from eqxzoo.nn.mlp import GATED
from eqxzoo.nn.moe import check_shared_experts
from eqxzoo.nn.rope import check_rotary_dim
from eqxzoo.nn.router import check_groups, check_top_k
from eqxzoo.typed_config import (
    ConfigError,
    architecture_field,
    check_fields,
    identity_field,
    keys_with_role,
    refuse,
    require_at_least,
    runtime_field,
)

__all__ = [
    "RUNTIME_KEYS",
    "ConfigError",
    "DecoderConfig",
    "LatentAttentionConfig",
    "LayerType",
    "LoraConfig",
    "MoEConfig",
    "NormKind",
    "NormPosition",
    "PositionKind",
    "QKNormOver",
    "RopeScaling",
]

LayerType = Literal["full_attention", "sliding_attention"]
NormKind = Literal["rms", "rms_plus_one", "layer"]
NormPosition = Literal["pre", "post", "both"]
QKNormOver = Literal["head", "all_heads"]
PositionKind = Literal["rope", "learned"]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (`eqxzoo.nn.lora`) of ``rank`` on the projections named in
    ``targets`` (the zoo's own names: ``wq``, ``wk``, ``wv``, ``wo`` of attention, ``wq_a``,
    ``wq_b``, ``wkv_a``, ``wkv_b`` of latent attention, ``gate``, ``up``, ``down`` of the
    MLPs, shared experts included; routed experts take none), scaled by ``alpha / rank``."""

    rank: int = identity_field(8)
    alpha: float = identity_field(16.0)
    targets: tuple[str, ...] = identity_field(("wq", "wk", "wv", "wo", "gate", "up", "down"))

    def __post_init__(self):
        check_fields(self)
        require_at_least(self, 1, "rank")
        if self.alpha <= 0:
            refuse("alpha", f"must be > 0, got {self.alpha}")
        if not self.targets:
            refuse("targets", 'names no projection: give at least one, e.g. ["wq", "wv"]')
        unknown = [name for name in self.targets if name not in adaptable_names()]
        if unknown:
            refuse(
                "targets",
                f"{', '.join(map(repr, unknown))} name(s) no projection of the zoo (its "
                f"projections: {', '.join(adaptable_names())})",
            )


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed experts (and optional shared experts) replacing every layer's MLP.

    ``routing``: ``"dropless"`` (every assignment computed), ``"capacity"`` (at most
    ``capacity_factor`` times the mean load per expert, the rest dropped) or ``"dense"``
    (every expert on every token: the reference); ``dropless_kernel`` how the dropless
    routing runs (`eqxzoo.nn.Experts`: ``"sorted"`` or ``"slotted"``). ``"auto"`` builds
    ``"sorted"``, which runs in any program; a run (`eqxzoo.run.config.model_config_for_mesh`)
    picks ``"slotted"`` instead where it is faster and its mesh allows it.

    The router (`eqxzoo.nn.Router`): ``scoring`` is ``"softmax"``, ``"sigmoid"``
    (DeepSeek-V3) or ``"softmax_topk"`` (GPT-OSS: softmax over the chosen logits);
    ``n_groups`` / ``topk_groups`` limit each token to its best groups of experts (DeepSeek);
    ``routed_scaling`` multiplies the routing weights; ``router_bias`` adds a trained bias to
    the logits (GPT-OSS); ``selection_bias`` adds DeepSeek-V3's balancing bias to the scores
    used for choosing, moved after each step by the run's ``loss.bias_update_rate``.

    The experts (`eqxzoo.nn.Experts`): ``expert_bias`` gives each of their projections a
    trained bias (GPT-OSS); ``expert_activation`` is ``"swiglu"`` or GPT-OSS's
    ``"clamped_swiglu"``, whose gate is clamped above at ``swiglu_limit``, its up projection
    to ``[-swiglu_limit, swiglu_limit]``, and whose sigmoid has gain ``swiglu_alpha`` (both
    unused by ``"swiglu"``).
    """

    n_experts: int = architecture_field(8)
    top_k: int = architecture_field(2)
    expert_mlp_dim: int = architecture_field(512)
    normalize_topk: bool = architecture_field(True)
    shared_mlp_dim: int = architecture_field(0)
    shared_gate: bool = architecture_field(False)
    scoring: Scoring = architecture_field("softmax")
    n_groups: int = architecture_field(1)
    topk_groups: int = architecture_field(1)
    routed_scaling: float = architecture_field(1.0)
    router_bias: bool = architecture_field(False)
    selection_bias: bool = architecture_field(False)
    expert_bias: bool = architecture_field(False)
    expert_activation: ExpertActivation = architecture_field("swiglu")
    swiglu_alpha: float = architecture_field(1.702)
    swiglu_limit: float = architecture_field(7.0)
    routing: RoutingMode = runtime_field("dropless")
    capacity_factor: float = runtime_field(1.25)
    dropless_kernel: Literal["auto"] | DroplessKernel = runtime_field("auto")

    @property
    def router_options(self) -> dict[str, Any]:
        """The `eqxzoo.nn.Router` options beyond ``top_k`` and ``normalize_topk``."""
        return dict(
            scoring=self.scoring,
            n_groups=self.n_groups,
            topk_groups=self.topk_groups,
            scaling=self.routed_scaling,
            bias=self.router_bias,
            selection_bias=self.selection_bias,
        )

    @property
    def expert_options(self) -> dict[str, Any]:
        """The `eqxzoo.nn.Experts` options."""
        return dict(
            bias=self.expert_bias,
            activation=self.expert_activation,
            alpha=self.swiglu_alpha,
            limit=self.swiglu_limit,
            dropless_kernel="sorted" if self.dropless_kernel == "auto" else self.dropless_kernel,
        )

    def __post_init__(self):
        check_fields(self)
        require_at_least(self, 1, "n_experts", "expert_mlp_dim")
        check_top_k(self.n_experts, self.top_k)
        check_shared_experts(self.shared_mlp_dim, self.shared_gate)
        if self.capacity_factor <= 0:
            refuse("capacity_factor", f"must be > 0, got {self.capacity_factor}")
        if self.routed_scaling <= 0:
            refuse("routed_scaling", f"must be > 0, got {self.routed_scaling}")
        if self.swiglu_limit <= 0:
            refuse("swiglu_limit", f"must be > 0, got {self.swiglu_limit}")
        check_groups(self.n_experts, self.top_k, self.n_groups, self.topk_groups)


@dataclasses.dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V2/V3), replacing every layer's attention.

    Queries come through a ``q_lora_rank`` bottleneck (None: one projection, V2-Lite);
    keys and values are expanded per head from one ``kv_lora_rank`` latent per token, which
    is what the KV cache keeps, beside one RoPE key of ``qk_rope_head_dim`` shared by all
    heads. Each head's query and key are ``qk_nope_head_dim`` features without position and
    ``qk_rope_head_dim`` rotated ones; its value has ``v_head_dim``. ``bias`` adds biases to
    the compressing projections and the output (``attention_bias``); ``norm_eps`` is the
    latent norms' epsilon (transformers builds them with 1e-6 whatever ``rms_norm_eps``).
    """

    q_lora_rank: int | None = architecture_field(None)
    kv_lora_rank: int = architecture_field(512)
    qk_nope_head_dim: int = architecture_field(128)
    qk_rope_head_dim: int = architecture_field(64)
    v_head_dim: int = architecture_field(128)
    bias: bool = architecture_field(False)
    norm_eps: float = architecture_field(1e-6)

    def __post_init__(self):
        check_fields(self)
        require_at_least(self, 1, "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
        require_at_least(self, 2, "qk_rope_head_dim")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            refuse("q_lora_rank", f"must be >= 1 (or unset), got {self.q_lora_rank}")
        check_rotary_dim(self.qk_rope_head_dim, "qk_rope_head_dim")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only transformer LM: the knobs of the shared builder (`models.decoder`).

    Shapes: ``head_dim`` defaults to ``d_model // n_heads`` and ``n_kv_heads`` to ``n_heads``
    (MHA); ``moe`` set: every layer's MLP is a MoE (``mlp_dim`` is then unused).

    Layout: ``norm`` is ``"rms"``, ``"rms_plus_one"`` (Gemma: scaled by ``1 + weight``) or
    ``"layer"``; ``norm_position`` puts it before each sublayer (``"pre"``), after it before
    the residual sum (``"post"``, OLMo 2) or both (``"both"``, Gemma 2/3). ``positions`` is
    ``"rope"`` (``rope_theta``, optional ``rope_scaling``) or ``"learned"`` (GPT-2: a table of
    ``max_positions`` rows).

    Attention: ``layer_types`` names each layer ``"full_attention"`` or
    ``"sliding_attention"`` (a window of ``sliding_window`` positions, the query's own
    included); unset, every layer is sliding when ``sliding_window`` is set (Mistral), or
    the family's pattern applies (`global_layer_every`). Fields given at the value their
    absence means are unset on construction, so equal models have equal configs. Sliding layers rotate with
    ``local_rope_theta`` when it is set (Gemma 3). Scores are scaled by
    ``attention_scale_dim^-0.5`` (default ``head_dim``) and soft-capped by
    ``attention_softcap``; logits by ``final_softcap``. ``attention_sinks`` gives each head a
    trained logit that joins its softmax (GPT-OSS). ``qk_norm`` normalises queries and keys
    per head (``qk_norm_over = "head"``) or over all heads (``"all_heads"``); ``clip_qkv``
    clamps them. ``scale_embeddings`` multiplies the embeddings by ``sqrt(d_model)``.

    Layers: with ``moe`` set, the first ``first_dense_layers`` layers keep a dense MLP of
    ``mlp_dim`` (DeepSeek's ``first_k_dense_replace``): their shapes differ from the MoE
    layers', so they form the model's ``prefix`` (run before the pipelined blocks) and
    ``n_layers`` counts both. ``latent_attention`` replaces every layer's attention by
    multi-head latent attention (`LatentAttentionConfig`).

    ``scan_layers``, ``remat``, ``attention_kernel`` and ``attention_block_size`` change how
    the layers run, never the parameters or what they compute: ``attention_kernel`` is
    `eqxzoo.nn.attend`'s (``"auto"``: cuDNN on a GPU where it supports the layers' options,
    the blockwise kernel with key blocks of ``attention_block_size`` elsewhere).
    ``context_parallel`` is how attention crosses the shards of a sequence split over the
    ``cp`` mesh axis (``"ring"`` or ``"all_gather"``, `eqxzoo.nn.context_attend`);
    ``context_axis`` names that axis, set by the trainer where ``mesh.cp > 1``
    (`eqxzoo.run.config.model_config_for_mesh`): a model built with it runs only inside a
    region manual over that axis, on shards of the sequences. Likewise ``expert_axis``, set
    where ``mesh.ep > 1`` for a MoE model: its routed experts are split over that axis, each
    device holding its own tokens and exchanging them with the devices of their experts
    (`eqxzoo.nn.ExpertSplit`).
    """

    family: ClassVar[str] = "decoder"
    # With no layer_types given, layer i is full attention when (i + 1) % this == 0 and
    # sliding otherwise (Gemma's pattern); None: every layer sliding when a window is set.
    global_layer_every: ClassVar[int | None] = None

    vocab_size: int = architecture_field(32000)
    d_model: int = architecture_field(512)
    n_layers: int = architecture_field(8)
    n_heads: int = architecture_field(8)
    n_kv_heads: int | None = architecture_field(None)
    head_dim: int | None = architecture_field(None)
    mlp_dim: int = architecture_field(1408)
    activation: Activation = architecture_field("swiglu")
    norm: NormKind = architecture_field("rms")
    norm_eps: float = architecture_field(1e-6)
    norm_position: NormPosition = architecture_field("pre")
    positions: PositionKind = architecture_field("rope")
    max_positions: int = architecture_field(0)
    rope_theta: float = architecture_field(10000.0)
    rope_scaling: RopeScaling | None = architecture_field(None)
    local_rope_theta: float | None = architecture_field(None)
    sliding_window: int | None = architecture_field(None)
    layer_types: tuple[LayerType, ...] | None = architecture_field(None)
    qkv_bias: bool = architecture_field(False)
    attention_out_bias: bool = architecture_field(False)
    mlp_bias: bool = architecture_field(False)
    qk_norm: bool = architecture_field(False)
    qk_norm_over: QKNormOver = architecture_field("head")
    clip_qkv: float | None = architecture_field(None)
    attention_scale_dim: int | None = architecture_field(None)
    attention_softcap: float | None = architecture_field(None)
    attention_sinks: bool = architecture_field(False)
    final_softcap: float | None = architecture_field(None)
    scale_embeddings: bool = architecture_field(False)
    tie_embeddings: bool = architecture_field(False)
    init_std: float = architecture_field(0.02)
    moe: MoEConfig | None = None
    first_dense_layers: int = architecture_field(0)
    latent_attention: LatentAttentionConfig | None = None
    lora: LoraConfig | None = None
    scan_layers: bool = runtime_field(True)
    remat: RematPolicy = runtime_field("none")
    attention_kernel: AttentionKernel = runtime_field("auto")
    attention_block_size: int = runtime_field(DEFAULT_BLOCK_SIZE)
    context_parallel: ContextStrategy = runtime_field("ring")
    context_axis: str | None = runtime_field(None)
    expert_axis: str | None = runtime_field(None)

    def __post_init__(self):
        check_fields(self)
        require_at_least(
            self,
            1,
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "mlp_dim",
            "attention_block_size",
        )
        check_kv_heads(self.n_heads, self.kv_heads)
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            refuse(
                "head_dim",
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: set head_dim",
            )
        if self.positions == "rope":
            check_rotary_dim(self.attention_head_dim, "head_dim")
        if self.positions == "learned":
            if self.max_positions < 1:
                refuse("max_positions", "learned positions need a table: set max_positions >= 1")
            if self.rope_scaling is not None or self.local_rope_theta is not None:
                refuse("positions", "'learned' positions take no rotary settings")
        for name in ("clip_qkv", "attention_scale_dim", "attention_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                refuse(name, f"must be > 0 (or unset), got {value}")
        if self.sliding_window is not None and self.sliding_window < 1:
            refuse("sliding_window", f"must be >= 1 (or unset), got {self.sliding_window}")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            refuse(
                "layer_types",
                f"names {len(self.layer_types)} layers but n_layers is {self.n_layers}",
            )
        if "sliding_attention" in self.attention_layer_types and self.sliding_window is None:
            refuse("layer_types", "'sliding_attention' layers need sliding_window")
        if self.local_rope_theta is not None and self.sliding_window is None:
            refuse("local_rope_theta", "applies to sliding-window layers: set sliding_window")
        if self.first_dense_layers:
            if self.moe is None:
                refuse("first_dense_layers", "dense first layers need MoE layers after them")
            if not 0 < self.first_dense_layers < self.n_layers:
                refuse(
                    "first_dense_layers",
                    f"must be in [0, n_layers={self.n_layers}), got {self.first_dense_layers}",
                )
        if self.latent_attention is not None and self.positions != "rope":
            refuse("latent_attention", "latent attention needs rotary positions")
        if self.latent_attention is not None and self.attention_sinks:
            refuse("attention_sinks", "latent attention has no attention sinks; set it to false")
        if self.lora is not None:
            self._check_lora_targets(self.lora)
        if self.attention_kernel == "cudnn":
            self._check_cudnn_expresses_attention()
        self._canonicalize()

    def projection_sizes(self) -> dict[str, int]:
        """The projections of this model a LoRA target may name (`LoraConfig`), each with
        the smaller of its input and output sizes (the largest rank that means anything)."""
        heads, latent = self.n_heads, self.latent_attention
        if latent is None:
            head_dim = self.attention_head_dim
            q, kv = heads * head_dim, self.kv_heads * head_dim
            sizes = {"wq": min(self.d_model, q), "wk": min(self.d_model, kv)}
            sizes |= {"wv": sizes["wk"], "wo": sizes["wq"]}
        else:
            qk_head_dim = latent.qk_nope_head_dim + latent.qk_rope_head_dim
            if latent.q_lora_rank is None:
                sizes = {"wq": min(self.d_model, heads * qk_head_dim)}
            else:
                sizes = {
                    "wq_a": min(self.d_model, latent.q_lora_rank),
                    "wq_b": min(latent.q_lora_rank, heads * qk_head_dim),
                }
            sizes["wkv_a"] = min(self.d_model, latent.kv_lora_rank + latent.qk_rope_head_dim)
            expanded = heads * (latent.qk_nope_head_dim + latent.v_head_dim)
            sizes["wkv_b"] = min(latent.kv_lora_rank, expanded)
            sizes["wo"] = min(heads * latent.v_head_dim, self.d_model)
        widths = [self.mlp_dim] if self.moe is None or self.first_dense_layers else []
        widths += (
            [self.moe.shared_mlp_dim] if self.moe is not None and self.moe.shared_mlp_dim else []
        )
        if widths:
            mlp = min(self.d_model, *widths)
            names = ("gate", "up", "down") if self.activation in GATED else ("up", "down")
            sizes |= dict.fromkeys(names, mlp)
        return sizes

    def _check_lora_targets(self, lora: LoraConfig) -> None:
        sizes = self.projection_sizes()
        absent = [name for name in lora.targets if name not in sizes]
        if absent:
            refuse(
                "lora.targets",
                f"{', '.join(map(repr, absent))} name(s) no projection of this "
                f"{self.family} model (it has {', '.join(sizes)})",
            )
        too_small = {name: sizes[name] for name in lora.targets if sizes[name] < lora.rank}
        if too_small:
            name, size = min(too_small.items(), key=lambda item: item[1])
            refuse(
                "lora.rank",
                f"{lora.rank} is larger than projection {name!r} ({size} wide): a rank beyond "
                "a projection's smaller side adds nothing; lower it",
            )

    def _check_cudnn_expresses_attention(self) -> None:
        supported = cudnn_supports(
            dtype=jnp.bfloat16,
            windowed=self.layer_windows is not None,
            softcap=self.attention_softcap,
            sinks=self.attention_sinks,
            same_head_dims=self.latent_attention is None,
            positions_are_indices=True,
        )
        if supported is not True:
            refuse(
                "attention_kernel",
                f"'cudnn' cannot compute this model's attention ({supported}): "
                "use 'auto' or 'blockwise'",
            )

    def _canonicalize(self) -> None:
        """Unset the fields given at the value their absence means (``head_dim = d_model /
        n_heads``, ``n_kv_heads = n_heads``, the default ``layer_types``), so that equal
        models have equal configs however they were written."""
        if self.head_dim is not None and self.head_dim * self.n_heads == self.d_model:
            object.__setattr__(self, "head_dim", None)
        if self.n_kv_heads == self.n_heads:
            object.__setattr__(self, "n_kv_heads", None)
        if self.layer_types is not None:
            given = self.layer_types
            object.__setattr__(self, "layer_types", None)
            if self.attention_layer_types != given:
                object.__setattr__(self, "layer_types", given)

    @property
    def context_split(self) -> ContextSplit | None:
        """The layers' `ContextSplit` where the sequence is split over ``context_axis``."""
        if self.context_axis is None:
            return None
        return ContextSplit(self.context_axis, self.context_parallel)

    @property
    def expert_split(self) -> ExpertSplit | None:
        """The MoE layers' `ExpertSplit` where the experts are split over ``expert_axis``."""
        return None if self.expert_axis is None else ExpertSplit(self.expert_axis)

    @property
    def n_blocks(self) -> int:
        """The repeated (pipelined) layers: every layer after the prefix."""
        return self.n_layers - self.first_dense_layers

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def attention_head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def attention_layer_types(self) -> tuple[LayerType, ...]:
        """Each layer's attention: ``layer_types``, or the default described above."""
        if self.layer_types is not None:
            return self.layer_types
        if self.sliding_window is None:
            return ("full_attention",) * self.n_layers
        every = self.global_layer_every
        return tuple(
            "full_attention" if every is not None and (i + 1) % every == 0 else "sliding_attention"
            for i in range(self.n_layers)
        )

    @property
    def layer_windows(self) -> tuple[int, ...] | None:
        """Each layer's window (0: full attention); None when no layer has one."""
        if self.sliding_window is None:
            return None
        return tuple(
            self.sliding_window if kind == "sliding_attention" else 0
            for kind in self.attention_layer_types
        )


# The keys declared `runtime_field`: they choose how the zoo runs the same parameters, never
# what the parameters are (a Hugging Face config states none of them; a resume may change them).
RUNTIME_KEYS = keys_with_role(DecoderConfig, "runtime")
