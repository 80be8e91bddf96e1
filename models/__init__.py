"""The eqxzoo model zoo: dense and Mixture-of-Experts decoder LMs as plain Equinox modules.

import jax, models
model = models.DecoderLM(models.LlamaConfig(vocab_size=1000, d_model=64, n_layers=2,
                                            n_heads=4, mlp_dim=128), key=jax.random.key(0))
logits, aux = model(jax.numpy.arange(16))
"""

from models.config import (
    FAMILIES,
    ConfigError,
    DecoderConfig,
    LlamaConfig,
    MixtralConfig,
    MoEConfig,
    QwenMoeConfig,
    config_from_table,
)
from models.decoder import DecoderBlock, DecoderLM, KVCache, summarize_layer_aux
from models.generate import (
    decode_step,
    generate,
    prefill,
    sample_token,
    top_k_filter,
    top_p_filter,
)
from models.hf import HFCheckpointError, load_hf, save_hf

__all__ = [
    "FAMILIES",
    "ConfigError",
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLM",
    "HFCheckpointError",
    "KVCache",
    "LlamaConfig",
    "MixtralConfig",
    "MoEConfig",
    "QwenMoeConfig",
    "config_from_table",
    "decode_step",
    "generate",
    "load_hf",
    "prefill",
    "sample_token",
    "save_hf",
    "summarize_layer_aux",
    "top_k_filter",
    "top_p_filter",
]
