"""Mistral (``MistralForCausalLM``): Llama's layout with a sliding window in every layer."""

import dataclasses
from typing import Any, ClassVar

from eqxzoo.typed_config import refuse
from models.config import DecoderConfig
from models.decoder import DecoderLM
from models.family import Family, HFConfig, Tensor, llama_like_mapping
from models.hf_fields import common_fields, common_hf_fields
from models.hf_tensors import llama_like_tensors, mlp_tensors


@dataclasses.dataclass(frozen=True)
class MistralConfig(DecoderConfig):
    """Dense Mistral: Llama with every layer attending to the last ``sliding_window``
    positions (unset: full causal attention, as Mistral 7B v0.2 onwards)."""

    family: ClassVar[str] = "mistral"
    sliding_window: int | None = 4096

    def __post_init__(self):
        super().__post_init__()
        if self.moe is not None:
            refuse("moe", "mistral is dense: use family 'mixtral' for experts")


ARCHITECTURE = "MistralForCausalLM"


def config_from_hf(hf_config: HFConfig) -> MistralConfig:
    return MistralConfig(
        **common_fields(hf_config), sliding_window=hf_config.values.get("sliding_window")
    )


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    free = frozenset({"rope_scaling", "sliding_window"})
    fields = common_hf_fields(config, ARCHITECTURE, free=free)
    return {**fields, "sliding_window": config.sliding_window}


def tensors(config: DecoderConfig) -> list[Tensor]:
    return llama_like_tensors(config) + mlp_tensors()


FAMILY = Family(
    name="mistral",
    config_class=MistralConfig,
    model_class=DecoderLM,
    tiny=dict(sliding_window=3),
    hf=llama_like_mapping(
        architecture=ARCHITECTURE,
        model_type="mistral",
        defaults={"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
        handled_keys=frozenset({"sliding_window"}),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=tensors,
    ),
)
