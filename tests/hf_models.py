"""Tiny random Hugging Face models built in memory (no downloads), shared by the tests of
Hugging Face interop (`test_hf.py`) and of the trainer's road in and out (`test_hf_train.py`).
"""

import torch
import transformers

from models import LlamaConfig, MixtralConfig, QwenMoeConfig

VOCAB = 97

# name -> (architecture, config fields, sequence length); two layers each.
HF_CASES = {
    "llama_mha": (
        "LlamaForCausalLM",
        dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4),
        9,
    ),
    "llama_gqa": (
        "LlamaForCausalLM",
        dict(
            hidden_size=48,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
        13,
    ),
    "llama_tied": (
        "LlamaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        ),
        7,
    ),
    "llama_attention_bias": (
        "LlamaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
        ),
        11,
    ),
    "mixtral_top2_of_4": (
        "MixtralForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=24,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        12,
    ),
    "mixtral_top1_of_4": (
        "MixtralForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=16,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_local_experts=4,
            num_experts_per_tok=1,
            tie_word_embeddings=True,
        ),
        10,
    ),
    "qwen_moe_norm_topk": (
        "Qwen2MoeForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=40,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            qkv_bias=False,
            tie_word_embeddings=True,
        ),
        8,
    ),
    "qwen_moe_gqa": (
        "Qwen2MoeForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        ),
        14,
    ),
}

ZOO_FAMILY = {
    "LlamaForCausalLM": LlamaConfig,
    "MixtralForCausalLM": MixtralConfig,
    "Qwen2MoeForCausalLM": QwenMoeConfig,
}


def hf_config(architecture, **fields):
    """A transformers config for ``architecture`` (e.g. ``LlamaForCausalLM -> LlamaConfig``)."""
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    fields = dict(vocab_size=VOCAB, num_hidden_layers=2) | fields
    return config_class(**fields, attn_implementation="eager")


def randomize(hf_model, seed=0):
    """Re-draw every parameter: weights N(0, 0.1^2), norms 1 + N(0, 0.1^2).

    A std of 0.1 (not HF's 0.02) keeps attention scores and router logits far from uniform,
    so head order, rotary layout and routing mistakes change the logits. Llama's o_proj
    bias stays zero: the zoo's attention has no output bias.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            noise = 0.1 * torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_(1.0 + noise)
            elif name.endswith("o_proj.bias"):
                parameter.zero_()
            else:
                parameter.copy_(noise)
    return hf_model.eval()


def make_hf_model(case):
    architecture, fields, _ = HF_CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(hf_config(architecture, **fields))
    return randomize(model)
