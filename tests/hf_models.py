"""Tiny random Hugging Face models built in memory (no downloads), shared by the tests of
Hugging Face interop (`test_hf.py`) and of the trainer's road in and out (`test_hf_train.py`).
"""

import torch
import transformers

from models.registry import hf_architectures

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
    "llama3_rope": (
        "LlamaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=24,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        13,
    ),
    "llama_linear_rope": (
        "LlamaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
        9,
    ),
    "llama_dynamic_rope": (
        "LlamaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=6,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
        13,
    ),
    "mistral_window": (
        "MistralForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
        ),
        11,
    ),
    "mistral_mqa_no_window": (
        "MistralForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=12,
            sliding_window=None,
            tie_word_embeddings=True,
        ),
        9,
    ),
    "qwen3_tied": (
        "Qwen3ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        ),
        10,
    ),
    "qwen3_sliding_bias": (
        "Qwen3ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
        ),
        12,
    ),
    "qwen3_moe_norm_topk": (
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        11,
    ),
    "qwen3_moe_window_bias": (
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=12,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=5,
            tie_word_embeddings=True,
        ),
        12,
    ),
    "gemma2_softcapped": (
        "Gemma2ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
        11,
    ),
    "gemma2_untied_bias": (
        "Gemma2ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=40,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=3,
            attention_bias=True,
            tie_word_embeddings=False,
            final_logit_softcapping=None,
        ),
        9,
    ),
    "gemma3_local_global": (
        "Gemma3ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
        12,
    ),
    "gemma3_all_local_softcapped": (
        "Gemma3ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=40,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=5,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
            tie_word_embeddings=False,
        ),
        10,
    ),
    "olmo2_gqa": (
        "Olmo2ForCausalLM",
        dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2),
        10,
    ),
    "olmo2_bias_tied": (
        "Olmo2ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=40,
            num_attention_heads=2,
            num_key_value_heads=2,
            attention_bias=True,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        8,
    ),
    "olmoe_clip": (
        "OlmoeForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=16,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=6,
            num_experts_per_tok=2,
            clip_qkv=0.5,
        ),
        10,
    ),
    "olmoe_norm_topk_gqa": (
        "OlmoeForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=12,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
        9,
    ),
    # DeepSeek: layer 0 dense (the prefix), the rest MoE; YaRN with DeepSeek's softmax-scale
    # correction; one case per query layout, V2's group-limited and greedy routing.
    "deepseek_v3_q_lora": (
        "DeepseekV3ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=12,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            first_k_dense_replace=1,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            head_dim=8,
            max_position_embeddings=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        11,
    ),
    "deepseek_v3_no_q_lora": (
        "DeepseekV3ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=40,
            moe_intermediate_size=16,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=12,
            qk_nope_head_dim=16,
            qk_rope_head_dim=4,
            v_head_dim=8,
            head_dim=4,
            norm_topk_prob=False,
            attention_bias=True,
        ),
        10,
    ),
    "deepseek_v2_lite": (
        "DeepseekV2ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=12,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=2,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            head_dim=8,
            routed_scaling_factor=1.5,
        ),
        9,
    ),
    "deepseek_v2_grouped": (
        "DeepseekV2ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=12,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=20,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            head_dim=4,
        ),
        8,
    ),
    # Sliding and full layers alternating (Hugging Face's default layer_types), a window of 3
    # in 11 positions; a clamp limit the experts' projections reach.
    "gpt_oss_sliding_sinks": (
        "GptOssForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=3,
            swiglu_limit=0.3,
            swiglu_alpha=1.5,
            max_position_embeddings=131072,
            rope_parameters={  # GPT-OSS's own YaRN settings
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        ),
        11,
    ),
    "gpt2_tied": ("GPT2LMHeadModel", dict(n_embd=32, n_head=4, n_positions=16), 11),
    "gpt2_untied": (
        "GPT2LMHeadModel",
        dict(n_embd=24, n_head=2, n_inner=40, n_positions=12, tie_word_embeddings=False),
        12,
    ),
}

# The zoo config class of each Hugging Face architecture.
ZOO_FAMILY = {name: family.config_class for name, family in hf_architectures().items()}

# transformers' config classes whose names do not follow "XForCausalLM" -> "XConfig".
CONFIG_CLASSES = {"GPT2LMHeadModel": "GPT2Config", "Gemma3ForCausalLM": "Gemma3TextConfig"}


def hf_config(architecture, n_layers=2, **fields):
    """A transformers config for ``architecture`` (e.g. ``LlamaForCausalLM -> LlamaConfig``)
    with ``n_layers`` layers."""
    name = CONFIG_CLASSES.get(architecture, architecture.replace("ForCausalLM", "Config"))
    config_class = getattr(transformers, name)
    layers_key = "n_layer" if architecture == "GPT2LMHeadModel" else "num_hidden_layers"
    fields = {"vocab_size": VOCAB, layers_key: n_layers} | fields
    return config_class(**fields, attn_implementation="eager")


def randomize(hf_model, seed=0):
    """Re-draw every parameter: weights N(0, 0.1^2), norms 1 + N(0, 0.1^2); DeepSeek-V3's
    balancing bias (a buffer) N(0, 0.1^2).

    A std of 0.1 (not HF's 0.02) keeps attention scores and router logits far from uniform,
    so head order, rotary layout and routing mistakes change the logits.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            noise = 0.1 * torch.randn(parameter.shape, generator=generator)
            if "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                parameter.copy_(1.0 + noise)
            else:
                parameter.copy_(noise)
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's balancing bias
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return hf_model.eval()


def make_hf_model(case):
    architecture, fields, _ = HF_CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(hf_config(architecture, **fields))
    return randomize(model)
