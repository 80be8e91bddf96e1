"""Pure Equinox building blocks: norms, rotary embeddings, attention, MLPs, MoE, layer stacks."""

from eqxzoo.nn.attention import CausalSelfAttention, QKNorm, cache_slots
from eqxzoo.nn.axes import AbstractAxesOwner, Axes, LogicalName, logical_axes
from eqxzoo.nn.blockwise import blockwise_attend
from eqxzoo.nn.context import ContextSplit, balanced_order, context_attend
from eqxzoo.nn.contract import (
    HeadInputs,
    LanguageModel,
    layer_means,
    make_layers_for_keys,
    summarize_layer_aux,
)
from eqxzoo.nn.cross_entropy import fused_cross_entropy
from eqxzoo.nn.documents import Documents, documents_of
from eqxzoo.nn.expert_parallel import ExpertSplit
from eqxzoo.nn.experts import ExpertActivation, Experts, gated_activation
from eqxzoo.nn.grouped import grouped_matmul
from eqxzoo.nn.kernels import AttentionKernel, attend, dense_attend
from eqxzoo.nn.linear import Embedding, Linear, embedding_lookup, normal_init
from eqxzoo.nn.mla import LatentAttention, deinterleave_rope_columns, interleave_rope_columns
from eqxzoo.nn.mlp import MLP, Activation
from eqxzoo.nn.moe import MoE, RoutingMode
from eqxzoo.nn.norm import LayerNorm, RMSNorm
from eqxzoo.nn.rope import RopeScaling, apply_rope, rope_frequencies
from eqxzoo.nn.router import (
    BUFFER_FIELDS,
    Router,
    Routing,
    Scoring,
    balance_selection_bias,
    router_losses,
)
from eqxzoo.nn.stack import RematPolicy, Stack, apply_layers, remat

__all__ = [
    "BUFFER_FIELDS",
    "Scoring",
    "balance_selection_bias",
    "AbstractAxesOwner",
    "Activation",
    "AttentionKernel",
    "Axes",
    "CausalSelfAttention",
    "Documents",
    "Embedding",
    "ExpertActivation",
    "Experts",
    "HeadInputs",
    "LanguageModel",
    "LatentAttention",
    "LayerNorm",
    "Linear",
    "LogicalName",
    "MLP",
    "MoE",
    "RMSNorm",
    "RematPolicy",
    "Router",
    "Routing",
    "RoutingMode",
    "QKNorm",
    "RopeScaling",
    "Stack",
    "apply_layers",
    "apply_rope",
    "attend",
    "ContextSplit",
    "ExpertSplit",
    "balanced_order",
    "blockwise_attend",
    "cache_slots",
    "context_attend",
    "deinterleave_rope_columns",
    "dense_attend",
    "documents_of",
    "embedding_lookup",
    "fused_cross_entropy",
    "gated_activation",
    "interleave_rope_columns",
    "grouped_matmul",
    "logical_axes",
    "make_layers_for_keys",
    "normal_init",
    "remat",
    "rope_frequencies",
    "router_losses",
    "layer_means",
    "summarize_layer_aux",
]
