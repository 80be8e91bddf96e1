"""The shared decoder-LM builder every family is assembled with.

`DecoderLM` fulfils the model contract (`eqxzoo.nn.LanguageModel`): ``embed``, an optional
``prefix``, the stacked ``blocks``, ``head``, and ``block_keys`` / ``make_layers`` so the
trainer can create the blocks directly in its pipeline layout. A family is a
`models.config.DecoderConfig` subclass plus its Hugging Face mapping (`models.family`);
the builder reads only the config's fields.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from eqxzoo.nn import (
    MLP,
    CausalSelfAttention,
    Embedding,
    LayerNorm,
    Linear,
    MoE,
    RMSNorm,
    Stack,
    cache_slots,
    make_layers_for_keys,
    summarize_layer_aux,
)
from models.config import DecoderConfig
from models.family import Family

Norm = RMSNorm | LayerNorm


def make_norm(config: DecoderConfig) -> Norm:
    """The config's norm over ``d_model``."""
    if config.norm == "layer":
        return LayerNorm(config.d_model, eps=config.norm_eps)
    offset = 1.0 if config.norm == "rms_plus_one" else 0.0
    return RMSNorm(config.d_model, eps=config.norm_eps, weight_offset=offset)


class KVCache(eqx.Module):
    """Every layer's attention keys and values of a sequence's tokens so far.

    Stacked on a leading ``layers`` axis like the blocks, so a decode step is one
    `jax.lax.scan` over layers and cache together; the slots keep one static shape however far
    decoding has gone, so decoding compiles once. ``slot_positions[i]`` is the position whose
    key and value slot ``i`` holds (negative: not yet written); attention masks by it. A
    cache as long as the sequence holds position ``p`` in slot ``p``; a model whose every
    layer has a sliding window needs only its longest window, and its cache is a ring
    (position ``p`` in slot ``p % slots``). Keys are stored rotated (RoPE at their absolute
    positions). ``position`` is the next token's position. Build one with
    `DecoderLM.init_cache`; batch with `jax.vmap`.
    """

    keys: Float[Array, "layers slots kv_heads head_dim"]
    values: Float[Array, "layers slots kv_heads head_dim"]
    slot_positions: Int[Array, " slots"]
    position: Int[Array, ""]

    @property
    def slots(self) -> int:
        return self.keys.shape[1]


def _residual(
    h: Float[Array, "*batch seq embed"],
    pre_norm: Norm | None,
    sublayer: Callable[[Array], tuple[Array, Any]],
    post_norm: Norm | None,
) -> tuple[Float[Array, "*batch seq embed"], Any]:
    """``h + post_norm(sublayer(pre_norm(h)))`` (absent norms skipped). ``sublayer`` returns
    ``(output, extra)``; ``extra`` (MoE aux values, a layer's updated cache) is passed on."""
    out, extra = sublayer(h if pre_norm is None else pre_norm(h))
    return h + (out if post_norm is None else post_norm(out)), extra


class DecoderBlock(eqx.Module):
    """Residual block: ``h + attention(norm(h))``, then ``h + mlp(norm(h))``.

    The norms sit before each sublayer (``attention_norm``, ``mlp_norm``), after it before
    the residual sum (``attention_post_norm``, ``mlp_post_norm``) or both, as
    ``config.norm_position`` says. ``mlp`` is a dense `MLP` or a `MoE`; the block returns
    ``(h, aux)`` with the MoE's per-layer auxiliary values (empty for dense blocks).
    """

    attention_norm: Norm | None
    attention: CausalSelfAttention
    attention_post_norm: Norm | None
    mlp_norm: Norm | None
    mlp: MLP | MoE
    mlp_post_norm: Norm | None

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray):
        attention_key, mlp_key = jax.random.split(key)
        pre = config.norm_position in ("pre", "both")
        post = config.norm_position in ("post", "both")
        self.attention_norm = make_norm(config) if pre else None
        self.attention = CausalSelfAttention(
            config.d_model,
            config.n_heads,
            config.kv_heads,
            config.attention_head_dim,
            rope_theta=config.rope_theta if config.positions == "rope" else None,
            rope_scaling=config.rope_scaling,
            local_rope_theta=config.local_rope_theta,
            window=None if config.layer_windows is None else 0,
            qkv_bias=config.qkv_bias,
            out_bias=config.attention_out_bias,
            qk_norm=config.qk_norm_over if config.qk_norm else "none",
            norm_eps=config.norm_eps,
            norm_weight_offset=1.0 if config.norm == "rms_plus_one" else 0.0,
            clip_qkv=config.clip_qkv,
            scale=None if config.attention_scale_dim is None else config.attention_scale_dim**-0.5,
            softcap=config.attention_softcap,
            init_std=config.init_std,
            key=attention_key,
        )
        self.attention_post_norm = make_norm(config) if post else None
        self.mlp_norm = make_norm(config) if pre else None
        moe = config.moe
        if moe is None:
            self.mlp = MLP(
                config.d_model,
                config.mlp_dim,
                activation=config.activation,
                use_bias=config.mlp_bias,
                init_std=config.init_std,
                key=mlp_key,
            )
        else:
            self.mlp = MoE(
                config.d_model,
                moe.expert_mlp_dim,
                moe.n_experts,
                moe.top_k,
                normalize_topk=moe.normalize_topk,
                shared_mlp_dim=moe.shared_mlp_dim,
                shared_gate=moe.shared_gate,
                routing_mode=moe.routing,
                capacity_factor=moe.capacity_factor,
                init_std=config.init_std,
                key=mlp_key,
            )
        self.mlp_post_norm = make_norm(config) if post else None

    def _mlp(
        self, x: Float[Array, "*batch seq embed"]
    ) -> tuple[Float[Array, "*batch seq embed"], dict[str, Array]]:
        if isinstance(self.mlp, MoE):
            return self.mlp(x)
        return self.mlp(x), {}

    def __call__(
        self, h: Float[Array, "*batch seq embed"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "*batch seq embed"], dict[str, Array]]:
        h, _ = _residual(
            h, self.attention_norm, lambda x: (self.attention(x), {}), self.attention_post_norm
        )
        return _residual(h, self.mlp_norm, self._mlp, self.mlp_post_norm)

    def cached_forward(
        self,
        h: Float[Array, "seq embed"],
        keys: Float[Array, "slots kv_heads head_dim"],
        values: Float[Array, "slots kv_heads head_dim"],
        slot_positions: Int[Array, " slots"],
        start: Int[Array, ""],
    ) -> tuple[
        Float[Array, "seq embed"],
        Float[Array, "slots kv_heads head_dim"],
        Float[Array, "slots kv_heads head_dim"],
    ]:
        """The block on tokens at positions ``start, ...`` against this layer's cache.

        Returns the hidden states and the cache with these tokens' keys and values written.
        A MoE routes each token as its own one-token sequence: routing is per token, as in
        the full pass, and no expert capacity can drop a token (a capacity-routed model
        decodes as if dropless; its full pass agrees wherever that drops nothing).
        """

        def attention(x):
            out, new_keys, new_values = self.attention.cached_forward(
                x, keys, values, slot_positions, start
            )
            return out, (new_keys, new_values)

        def mlp(x):
            out, _ = self._mlp(x[:, None, :])
            return out[:, 0, :], None

        h, (keys, values) = _residual(h, self.attention_norm, attention, self.attention_post_norm)
        h, _ = _residual(h, self.mlp_norm, mlp, self.mlp_post_norm)
        return h, keys, values


class DecoderLM(eqx.Module):
    """A decoder-only language model: ``embed``, an optional ``prefix``, stacked ``blocks``,
    ``head`` (the model contract, `eqxzoo.nn.LanguageModel`).

    The parts can be driven separately (the pipeline runs ``blocks`` stage by stage between
    ``embed`` and ``head``); ``__call__`` composes them for one sequence. ``prefix`` is the
    contract's slot for first layers whose shapes differ from the block (None for every
    family so far; the KV-cache path does not run one yet). Batch with
    `jax.vmap`. The parts also take leading batch axes directly, with the same results as
    `jax.vmap` (the trainer uses this: token-flattened matmuls are faster than vmapped ones).
    Per-layer settings (sliding windows) are integer arrays inside the blocks, stacked like
    the weights (`layer_data`). ``config`` is kept (static) so the model can be saved and
    rebuilt.
    """

    embedding: Embedding
    position_embedding: Embedding | None
    prefix: Stack | None
    blocks: Stack
    final_norm: Norm
    unembedding: Linear | None
    config: DecoderConfig = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray):
        embed_key, blocks_key, head_key = jax.random.split(key, 3)
        self.embedding = Embedding(
            config.vocab_size, config.d_model, init_std=config.init_std, key=embed_key
        )
        self.position_embedding = (
            Embedding(
                config.max_positions,
                config.d_model,
                init_std=config.init_std,
                row_axis=None,
                key=jax.random.fold_in(embed_key, 1),
            )
            if config.positions == "learned"
            else None
        )
        self.prefix = None
        blocks = Stack(
            lambda layer_key: DecoderBlock(config, key=layer_key),
            config.n_layers,
            scan=config.scan_layers,
            remat_policy=config.remat,
            key=blocks_key,
        )
        self.blocks = eqx.tree_at(
            lambda s: s.layers, blocks, _with_layer_data(blocks.layers, config, (config.n_layers,))
        )
        self.final_norm = make_norm(config)
        self.unembedding = (
            None
            if config.tie_embeddings
            else Linear(
                config.d_model,
                config.vocab_size,
                in_axis="embed",
                out_axis="vocab",
                init_std=config.init_std,
                key=head_key,
            )
        )
        self.config = config

    def embed(
        self, tokens: Int[Array, "*batch seq"], positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "*batch seq embed"]:
        """Token embeddings (times ``sqrt(d_model)`` with ``scale_embeddings``), plus learned
        position embeddings at ``positions`` (default ``0, 1, ...``) where the model has them."""
        h = self.embedding(tokens)
        if self.config.scale_embeddings:
            h = h * jnp.asarray(self.config.d_model**0.5, h.dtype)
        if self.position_embedding is not None:
            if positions is None:
                positions = jnp.arange(tokens.shape[-1])
            h = h + self.position_embedding(positions)
        return h

    def block_keys(self, key: PRNGKeyArray) -> Key[Array, " layers"]:
        """The ``(n_layers,)`` keys ``DecoderLM(config, key=key)`` builds its blocks from."""
        _, blocks_key, _ = jax.random.split(key, 3)
        return jax.random.split(blocks_key, self.config.n_layers)

    def make_layers(self, layer_keys: Key[Array, "*stack"]) -> DecoderBlock:
        """Blocks for ``layer_keys`` of any shape, stacked on its axes (``blocks.layers`` for
        ``block_keys(key)``). The keys are the layers' in order (``block_keys`` reshaped),
        which places each layer's per-layer data with its weights."""
        config = self.config
        layers = make_layers_for_keys(lambda key: DecoderBlock(config, key=key), layer_keys)
        return _with_layer_data(layers, config, layer_keys.shape)

    def head(self, h: Float[Array, "*batch seq embed"]) -> Float[Array, "*batch seq vocab"]:
        """Final norm, the output projection (or the tied embedding) and, with
        ``final_softcap``, ``cap * tanh(logits / cap)``."""
        h = self.final_norm(h)
        logits = self.embedding.attend(h) if self.unembedding is None else self.unembedding(h)
        cap = self.config.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def __call__(
        self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "seq vocab"], dict[str, Array]]:
        h = self.embed(tokens)
        if self.prefix is not None:
            h, _ = self.prefix(h)
        h, layer_aux = self.blocks(h, key=key)
        return self.head(h), summarize_layer_aux(layer_aux)

    def cache_slots_needed(self, max_len: int) -> int:
        """The slots a cache needs for ``max_len`` positions: the longest window if every
        layer has one (a ring of the last positions), else all of them."""
        windows = self.config.layer_windows
        if windows is not None and min(windows) > 0:
            return min(max_len, max(windows))
        return max_len

    def init_cache(self, max_len: int, dtype: DTypeLike | None = None) -> KVCache:
        """An empty `KVCache` for up to ``max_len`` positions (prompt plus generated tokens):
        ``cache_slots_needed(max_len)`` slots. ``dtype`` defaults to the embedding's (the
        parameter dtype). A model with learned positions refuses more than it has."""
        config = self.config
        if config.positions == "learned" and max_len > config.max_positions:
            raise ValueError(
                f"max_len {max_len} exceeds the model's {config.max_positions} learned positions"
            )
        slots = self.cache_slots_needed(max_len)
        shape = (config.n_layers, slots, config.kv_heads, config.attention_head_dim)
        dtype = self.embedding.weight.dtype if dtype is None else dtype
        return KVCache(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            slot_positions=jnp.full((slots,), -1, jnp.int32),
            position=jnp.zeros((), jnp.int32),
        )

    def cached_forward(
        self, tokens: Int[Array, " seq"], cache: KVCache
    ) -> tuple[Float[Array, "seq vocab"], KVCache]:
        """Logits of ``tokens`` continuing the cached sequence, and the cache extended by them.

        ``tokens`` sit at positions ``cache.position, ...``; the logits equal those rows of
        ``self(whole_sequence)[0]``. A prompt goes through in one call (prefill), then one
        token per call (decode). The layers run as one `jax.lax.scan` over the stacked blocks
        and the stacked cache. Overflowing a cache that is not a ring is an error.
        """
        seq = tokens.shape[0]
        position = cache.position
        is_ring = self.cache_slots_needed(cache.slots + 1) == cache.slots
        if not is_ring:
            position = eqx.error_if(
                position,
                position + seq > cache.slots,
                "KVCache overflow: the tokens do not fit in max_len; build the cache larger",
            )
        positions = position + jnp.arange(seq)
        params, static = eqx.partition(self.blocks.layers, eqx.is_array)

        def one_layer(h, layer):
            layer_params, keys, values = layer
            block = eqx.combine(layer_params, static)
            h, keys, values = block.cached_forward(h, keys, values, cache.slot_positions, position)
            return h, (keys, values)

        h, (keys, values) = jax.lax.scan(
            one_layer, self.embed(tokens, positions), (params, cache.keys, cache.values)
        )
        slot_positions = cache.slot_positions.at[cache_slots(positions, cache.slots)].set(
            positions, mode="drop"
        )
        cache = KVCache(
            keys=keys, values=values, slot_positions=slot_positions, position=position + seq
        )
        return self.head(h), cache


def _with_layer_data(layers: DecoderBlock, config: DecoderConfig, shape: tuple[int, ...]):
    """Stacked ``layers`` (leading axes ``shape``, layers in order) with their per-layer data
    set from ``config``: each layer's sliding window."""
    windows = config.layer_windows
    if windows is None:
        return layers
    return eqx.tree_at(
        lambda b: b.attention.window, layers, jnp.asarray(windows, jnp.int32).reshape(shape)
    )


FAMILY = Family(name="decoder", config_class=DecoderConfig, model_class=DecoderLM, hf=None)
