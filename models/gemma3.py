"""Gemma 3 text (``Gemma3ForCausalLM``): Gemma 2's layout with five sliding-window layers to
each global one, QK-norm per head, a separate RoPE base for the sliding-window layers, no
attention soft-capping and optional final soft-capping.

transformers' Gemma 3 attention never applies ``attn_logit_softcapping`` (its config carries
the key, its attention does not read it): the zoo follows the model, not the key."""

import dataclasses
from typing import Any, ClassVar

from models.decoder import DecoderLM
from models.family import Family, HFConfig, llama_like_mapping
from models.gemma2 import GEMMA_KEYS, Gemma2Config, gemma_fields, gemma_tensors, gemma_to_hf


@dataclasses.dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    """Gemma 3: every sixth layer global; QK-norm; local layers rotate with their own base."""

    family: ClassVar[str] = "gemma3"
    global_layer_every: ClassVar[int | None] = 6
    rope_theta: float = 1e6
    local_rope_theta: float | None = 10000.0
    qk_norm: bool = True
    attention_softcap: float | None = None
    final_softcap: float | None = None


ARCHITECTURE = "Gemma3ForCausalLM"


def config_from_hf(hf_config: HFConfig) -> Gemma3Config:
    fields = gemma_fields(hf_config, local_rope=True)
    return Gemma3Config(**{**fields, "attention_softcap": None}, qk_norm=True)


def config_to_hf(config: Gemma2Config) -> dict[str, Any]:
    fixed = {"qk_norm": True, "attention_softcap": None}
    fields = gemma_to_hf(config, ARCHITECTURE, fixed=fixed, free=frozenset({"local_rope_theta"}))
    return {**fields, "use_bidirectional_attention": False}


FAMILY = Family(
    name="gemma3",
    config_class=Gemma3Config,
    model_class=DecoderLM,
    tiny=dict(sliding_window=3, layer_types=("sliding_attention", "full_attention") * 4),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="gemma3_text",
        defaults={
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "local_rope_theta": 10000.0,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
        },
        handled_keys=GEMMA_KEYS | {"rope_local_base_freq"},
        # The pattern that made layer_types (which transformers writes too).
        ignored_keys=frozenset({"_sliding_window_pattern", "sliding_window_pattern"}),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=gemma_tensors,
    ),
)
