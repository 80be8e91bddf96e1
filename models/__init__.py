"""The eqxzoo model zoo: dense and Mixture-of-Experts decoder LMs as plain Equinox modules.

    import jax, models
    model = models.DecoderLM(models.LlamaConfig(vocab_size=1000, d_model=64, n_layers=2,
                                                n_heads=4, mlp_dim=128), key=jax.random.key(0))
    logits, aux = model(jax.numpy.arange(16))

One file per family (``models/llama.py``, ``models/mixtral.py``, ``models/qwen_moe.py``):
its config class and its Hugging Face mapping. `models.registry` finds them.
"""

from eqxzoo.nn import summarize_layer_aux
from models.config import ConfigError, DecoderConfig, MoEConfig
from models.decoder import DecoderBlock, DecoderLM, KVCache
from models.generate import (
    decode_step,
    generate,
    prefill,
    sample_token,
    top_k_filter,
    top_p_filter,
)
from models.hf import HFCheckpointError, load_hf, save_hf
from models.llama import LlamaConfig
from models.mixtral import MixtralConfig
from models.qwen_moe import QwenMoeConfig
from models.registry import config_from_table, families, family_of, model_factory

__all__ = [
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
    "families",
    "family_of",
    "generate",
    "load_hf",
    "model_factory",
    "prefill",
    "sample_token",
    "save_hf",
    "summarize_layer_aux",
    "top_k_filter",
    "top_p_filter",
]
