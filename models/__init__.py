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
from models.decoder import DecoderBlock, DecoderLM, summarize_layer_aux
from models.hf import HFCheckpointError, load_hf, save_hf

__all__ = [
    "FAMILIES",
    "ConfigError",
    "HFCheckpointError",
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLM",
    "LlamaConfig",
    "MixtralConfig",
    "MoEConfig",
    "QwenMoeConfig",
    "config_from_table",
    "load_hf",
    "save_hf",
    "summarize_layer_aux",
]
