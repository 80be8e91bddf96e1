"""The eqxzoo model zoo: dense and Mixture-of-Experts decoder LMs as plain Equinox modules.

    import jax, models
    model = models.DecoderLM(models.LlamaConfig(vocab_size=1000, d_model=64, n_layers=2,
                                                n_heads=4, mlp_dim=128), key=jax.random.key(0))
    logits, aux = model(jax.numpy.arange(16))

One file per family (``models/llama.py``, ``models/gemma2.py``, ``models/gpt2.py``, ...): its
config class and its Hugging Face mapping. `models.registry` finds them.
"""

from eqxzoo.nn import summarize_layer_aux
from models.config import (
    ConfigError,
    DecoderConfig,
    LatentAttentionConfig,
    MoEConfig,
    RopeScaling,
)
from models.costs import (
    ParameterCounts,
    attention_flops_per_key,
    attention_flops_per_token,
    flops_per_token,
    parameter_counts,
)
from models.decoder import DecoderBlock, DecoderLM, KVCache
from models.deepseek_v2 import DeepseekV2Config
from models.deepseek_v3 import DeepseekV3Config
from models.gemma2 import Gemma2Config
from models.gemma3 import Gemma3Config
from models.generate import (
    decode_step,
    generate,
    prefill,
    sample_token,
    top_k_filter,
    top_p_filter,
)
from models.gpt2 import GPT2Config
from models.gpt_oss import GptOssConfig
from models.hf import HFCheckpointError, load_hf, save_hf
from models.llama import LlamaConfig
from models.mistral import MistralConfig
from models.mixtral import MixtralConfig
from models.olmo2 import Olmo2Config
from models.olmoe import OlmoeConfig
from models.qwen3 import Qwen3Config
from models.qwen3_moe import Qwen3MoeConfig
from models.qwen_moe import QwenMoeConfig
from models.registry import config_from_table, families, family_of, model_factory

__all__ = [
    "ConfigError",
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLM",
    "DeepseekV2Config",
    "DeepseekV3Config",
    "GPT2Config",
    "Gemma2Config",
    "Gemma3Config",
    "GptOssConfig",
    "HFCheckpointError",
    "KVCache",
    "LatentAttentionConfig",
    "LlamaConfig",
    "MistralConfig",
    "MixtralConfig",
    "MoEConfig",
    "Olmo2Config",
    "OlmoeConfig",
    "ParameterCounts",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "QwenMoeConfig",
    "RopeScaling",
    "attention_flops_per_key",
    "attention_flops_per_token",
    "config_from_table",
    "decode_step",
    "families",
    "flops_per_token",
    "family_of",
    "generate",
    "load_hf",
    "model_factory",
    "parameter_counts",
    "prefill",
    "sample_token",
    "save_hf",
    "summarize_layer_aux",
    "top_k_filter",
    "top_p_filter",
]
