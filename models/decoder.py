"""The shared decoder-LM builder every family is assembled with.

`DecoderLM` fulfils the model contract (`eqxzoo.nn.LanguageModel`): ``embed``, an optional
``prefix``, the stacked ``blocks``, ``head``, and ``block_keys`` / ``make_layers`` so the
trainer can create the blocks directly in its pipeline layout. A family is a
`models.config.DecoderConfig` subclass plus its Hugging Face mapping (`models.family`);
the builder reads only the config's fields.
"""

import functools
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
    Documents,
    Embedding,
    HeadInputs,
    LatentAttention,
    LayerNorm,
    Linear,
    MoE,
    RMSNorm,
    Stack,
    cache_slots,
    make_layers_for_keys,
    summarize_layer_aux,
)
from eqxzoo.nn.linear import dense
from eqxzoo.nn.lora import add_adapters
from models.config import DecoderConfig, LoraConfig
from models.family import Family

Norm = RMSNorm | LayerNorm


def make_norm(config: DecoderConfig) -> Norm:
    """The config's norm over ``d_model``."""
    if config.norm == "layer":
        return LayerNorm(config.d_model, eps=config.norm_eps)
    offset = 1.0 if config.norm == "rms_plus_one" else 0.0
    return RMSNorm(config.d_model, eps=config.norm_eps, weight_offset=offset)


class KVCache(eqx.Module):
    """Every layer's attention cache of a sequence's tokens so far.

    ``layers`` holds the blocks' cache arrays stacked on a leading ``layers`` axis like the
    blocks (keys and values for `CausalSelfAttention`; the compressed latent and the RoPE
    key for `LatentAttention`: each attention's ``empty_cache``), so a decode step is one
    `jax.lax.scan` over layers and cache together; ``prefix_layers`` the same for the
    prefix's layers (None without a prefix). The slots keep one static shape however far
    decoding has gone, so decoding compiles once. ``slot_positions[i]`` is the position
    whose entries slot ``i`` holds (negative: not yet written); attention masks by it. A
    cache as long as the sequence holds position ``p`` in slot ``p``; a model whose every
    layer has a sliding window needs only its longest window, and its cache is a ring
    (position ``p`` in slot ``p % slots``). Keys are stored rotated (RoPE at their absolute
    positions). ``position`` is the next token's position. Build one with
    `DecoderLM.init_cache`; batch with `jax.vmap`.
    """

    layers: tuple[Float[Array, "layers slots ..."], ...]
    prefix_layers: tuple[Float[Array, "prefix_layers slots ..."], ...] | None
    slot_positions: Int[Array, " slots"]
    position: Int[Array, ""]

    @property
    def slots(self) -> int:
        return self.slot_positions.shape[0]


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
    ``config.norm_position`` says. ``mlp`` is a `MoE` when the config has one and the block
    is not ``dense`` (a prefix layer), else an `MLP`; the block returns ``(h, aux)`` with
    the MoE's per-layer auxiliary values (empty for dense blocks). ``attention`` is
    `LatentAttention` with ``config.latent_attention``, else `CausalSelfAttention`.
    """

    attention_norm: Norm | None
    attention: CausalSelfAttention | LatentAttention
    attention_post_norm: Norm | None
    mlp_norm: Norm | None
    mlp: MLP | MoE
    mlp_post_norm: Norm | None

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray, dense: bool = False):
        attention_key, mlp_key = jax.random.split(key)
        pre = config.norm_position in ("pre", "both")
        post = config.norm_position in ("post", "both")
        self.attention_norm = make_norm(config) if pre else None
        self.attention = make_attention(config, attention_key)
        self.attention_post_norm = make_norm(config) if post else None
        self.mlp_norm = make_norm(config) if pre else None
        moe = config.moe
        if moe is None or dense:
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
                router=moe.router_options,
                experts=moe.expert_options,
                shared_mlp_dim=moe.shared_mlp_dim,
                shared_gate=moe.shared_gate,
                routing_mode=moe.routing,
                capacity_factor=moe.capacity_factor,
                context=config.context_split,
                expert_split=config.expert_split,
                init_std=config.init_std,
                key=mlp_key,
            )
        self.mlp_post_norm = make_norm(config) if post else None
        if config.lora is not None:
            self.attention, self.mlp = _with_adapters(
                (self.attention, self.mlp), config.lora, jax.random.fold_in(key, 2)
            )

    def _mlp(
        self, x: Float[Array, "*batch seq embed"]
    ) -> tuple[Float[Array, "*batch seq embed"], dict[str, Array]]:
        if isinstance(self.mlp, MoE):
            return self.mlp(x)
        return self.mlp(x), {}

    def __call__(
        self,
        h: Float[Array, "*batch seq embed"],
        *,
        documents: Documents | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "*batch seq embed"], dict[str, Array]]:
        def attention(x):
            return self.attention(x, documents=documents), {}

        h, _ = _residual(h, self.attention_norm, attention, self.attention_post_norm)
        return _residual(h, self.mlp_norm, self._mlp, self.mlp_post_norm)

    def cached_forward(
        self,
        h: Float[Array, "seq embed"],
        cache: tuple[Array, ...],
        slot_positions: Int[Array, " slots"],
        start: Int[Array, ""],
    ) -> tuple[Float[Array, "seq embed"], tuple[Array, ...]]:
        """The block on tokens at positions ``start, ...`` against this layer's ``cache``
        (its attention's ``empty_cache`` layout).

        Returns the hidden states and the cache with these tokens written. A MoE routes each
        token as its own one-token sequence: routing is per token, as in the full pass, and
        no expert capacity can drop a token (a capacity-routed model decodes as if dropless;
        its full pass agrees wherever that drops nothing).
        """

        def attention(x):
            return self.attention.cached_forward(x, cache, slot_positions, start)

        def mlp(x):
            out, _ = self._mlp(x[:, None, :])
            return out[:, 0, :], None

        h, cache = _residual(h, self.attention_norm, attention, self.attention_post_norm)
        h, _ = _residual(h, self.mlp_norm, mlp, self.mlp_post_norm)
        return h, cache


def _with_adapters(modules: tuple, lora: LoraConfig, key: PRNGKeyArray) -> tuple:
    """The block's attention and MLP with `LoraConfig`'s adapters (a MoE's on its shared
    experts; the routed experts take none)."""
    attention_key, mlp_key = jax.random.split(key)
    attention, mlp = modules
    adapt = functools.partial(add_adapters, targets=lora.targets, rank=lora.rank, alpha=lora.alpha)
    attention = adapt(attention, key=attention_key)
    if isinstance(mlp, MoE):
        if mlp.shared is not None:
            mlp = eqx.tree_at(lambda m: m.shared, mlp, adapt(mlp.shared, key=mlp_key))
    else:
        mlp = adapt(mlp, key=mlp_key)
    return attention, mlp


def make_attention(
    config: DecoderConfig, key: PRNGKeyArray
) -> CausalSelfAttention | LatentAttention:
    """The attention of one layer of ``config``."""
    latent = config.latent_attention
    if latent is not None:
        return LatentAttention(
            config.d_model,
            config.n_heads,
            q_lora_rank=latent.q_lora_rank,
            kv_lora_rank=latent.kv_lora_rank,
            qk_nope_head_dim=latent.qk_nope_head_dim,
            qk_rope_head_dim=latent.qk_rope_head_dim,
            v_head_dim=latent.v_head_dim,
            rope_theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            attention_bias=latent.bias,
            norm_eps=latent.norm_eps,
            kernel=config.attention_kernel,
            block_size=config.attention_block_size,
            context=config.context_split,
            init_std=config.init_std,
            key=key,
        )
    return CausalSelfAttention(
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
        sinks=config.attention_sinks,
        kernel=config.attention_kernel,
        block_size=config.attention_block_size,
        context=config.context_split,
        init_std=config.init_std,
        key=key,
    )


class DecoderLM(eqx.Module):
    """A decoder-only language model: ``embed``, an optional ``prefix``, stacked ``blocks``,
    ``head`` (the model contract, `eqxzoo.nn.LanguageModel`).

    The parts can be driven separately (the pipeline runs ``blocks`` stage by stage between
    ``embed`` and ``head``); ``__call__`` composes them for one sequence. ``prefix`` holds
    the ``first_dense_layers`` layers whose MLP is dense where the blocks' is a MoE
    (DeepSeek; None without them), run after ``embed`` and, in the KV cache, before the
    blocks. Batch with `jax.vmap`. The parts also take leading batch axes directly, with the same results as
    `jax.vmap` (the trainer uses this: token-flattened matmuls are faster than vmapped ones).
    Per-layer settings (sliding windows) are integer arrays inside the blocks, stacked like
    the weights (`_with_windows`). ``config`` is kept (static) so the model can be saved and
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
        n_prefix = config.first_dense_layers
        self.prefix = None
        if n_prefix:
            prefix = Stack(
                lambda layer_key: DecoderBlock(config, key=layer_key, dense=True),
                n_prefix,
                scan=config.scan_layers,
                remat_policy=config.remat,
                key=jax.random.fold_in(blocks_key, 1),
            )
            windows = _windows(config, prefix=True)
            self.prefix = eqx.tree_at(
                lambda s: s.layers, prefix, _with_windows(prefix.layers, windows, (n_prefix,))
            )
        blocks = Stack(
            lambda layer_key: DecoderBlock(config, key=layer_key),
            config.n_blocks,
            scan=config.scan_layers,
            remat_policy=config.remat,
            key=blocks_key,
        )
        self.blocks = eqx.tree_at(
            lambda s: s.layers,
            blocks,
            _with_windows(blocks.layers, _windows(config), (config.n_blocks,)),
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
        self, tokens: Int[Array, "*batch seq"], positions: Int[Array, "*#batch seq"] | None = None
    ) -> Float[Array, "*batch seq embed"]:
        """Token embeddings (times ``sqrt(d_model)`` with ``scale_embeddings``), plus learned
        position embeddings at ``positions`` (default ``0, 1, ...``; per sequence with packed
        documents) where the model has them."""
        h = self.embedding(tokens)
        if self.config.scale_embeddings:
            h = h * jnp.asarray(self.config.d_model**0.5, h.dtype)
        if self.position_embedding is not None:
            if positions is None:
                positions = jnp.arange(tokens.shape[-1])
            h = h + self.position_embedding(positions)
        return h

    def block_keys(self, key: PRNGKeyArray) -> Key[Array, " layers"]:
        """The ``(n_blocks,)`` keys ``DecoderLM(config, key=key)`` builds its blocks from."""
        _, blocks_key, _ = jax.random.split(key, 3)
        return jax.random.split(blocks_key, self.config.n_blocks)

    def make_layers(self, layer_keys: Key[Array, "*stack"]) -> DecoderBlock:
        """Blocks for ``layer_keys`` of any shape, stacked on its axes (``blocks.layers`` for
        ``block_keys(key)``). The keys are the layers' in order (``block_keys`` reshaped),
        which places each layer's per-layer data with its weights."""
        config = self.config
        layers = make_layers_for_keys(lambda key: DecoderBlock(config, key=key), layer_keys)
        return _with_windows(layers, _windows(config), layer_keys.shape)

    def head(self, h: Float[Array, "*batch seq embed"]) -> Float[Array, "*batch seq vocab"]:
        """Final norm, the output projection (or the tied embedding) and, with
        ``final_softcap``, ``cap * tanh(logits / cap)``."""
        features, projection, vocab_major, cap = self.head_inputs(h)
        logits = dense(features, projection.T if vocab_major else projection)
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def head_inputs(self, h: Float[Array, "*batch seq embed"]) -> HeadInputs:
        """What `head` makes the logits of: the final-normed states, the output projection
        (the tied embedding table, vocabulary-major) and the final soft-cap. The trainer's
        fused loss takes these instead of the logits (`eqxzoo.nn.fused_cross_entropy`)."""
        features, cap = self.final_norm(h), self.config.final_softcap
        if self.unembedding is None:
            return HeadInputs(features, self.embedding.weight, True, cap)
        assert self.unembedding.bias is None, "the output projection has no bias"
        return HeadInputs(features, self.unembedding.weight, False, cap)

    def __call__(
        self,
        tokens: Int[Array, " seq"],
        *,
        documents: Documents | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "seq vocab"], dict[str, Array]]:
        """Logits and the layers' aux values; with ``documents`` the packed documents of
        ``tokens`` attend each within itself, at positions counted from its start."""
        h = self.embed(tokens, None if documents is None else documents.positions)
        if self.prefix is not None:
            h, _ = self.prefix(h, documents=documents)
        h, layer_aux = self.blocks(h, documents=documents, key=key)
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
        dtype = self.embedding.weight.dtype if dtype is None else dtype

        def stacked_cache(stack: Stack) -> tuple[Array, ...]:
            attention = stack.layers.attention
            empty = jax.eval_shape(lambda: _first_layer(attention).empty_cache(slots, dtype))
            return tuple(jnp.zeros((stack.n_layers, *e.shape), e.dtype) for e in empty)

        return KVCache(
            layers=stacked_cache(self.blocks),
            prefix_layers=None if self.prefix is None else stacked_cache(self.prefix),
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

        def run_layers(h, stack: Stack, layer_caches: tuple[Array, ...]):
            params, static = eqx.partition(stack.layers, eqx.is_array)

            def one_layer(h, layer):
                layer_params, layer_cache = layer
                block = eqx.combine(layer_params, static)
                return block.cached_forward(h, layer_cache, cache.slot_positions, position)

            return jax.lax.scan(one_layer, h, (params, layer_caches))

        h = self.embed(tokens, positions)
        prefix_layers = None
        if self.prefix is not None:
            h, prefix_layers = run_layers(h, self.prefix, cache.prefix_layers)
        h, layers = run_layers(h, self.blocks, cache.layers)
        slot_positions = cache.slot_positions.at[cache_slots(positions, cache.slots)].set(
            positions, mode="drop"
        )
        cache = KVCache(
            layers=layers,
            prefix_layers=prefix_layers,
            slot_positions=slot_positions,
            position=position + seq,
        )
        return self.head(h), cache


def _first_layer(stacked: Any) -> Any:
    """One layer of stacked layers (arrays indexed at 0 on the leading axis)."""
    return jax.tree.map(lambda a: a[0] if eqx.is_array(a) else a, stacked)


def _windows(config: DecoderConfig, *, prefix: bool = False) -> tuple[int, ...] | None:
    """The sliding windows of the blocks' layers (or, with ``prefix``, of the prefix's)."""
    windows = config.layer_windows
    if windows is None:
        return None
    n_prefix = config.first_dense_layers
    return windows[:n_prefix] if prefix else windows[n_prefix:]


def _with_windows(layers: DecoderBlock, windows: tuple[int, ...] | None, shape: tuple[int, ...]):
    """Stacked ``layers`` (leading axes ``shape``, layers in order) with each layer's sliding
    window set from ``windows`` (per-layer data; unchanged when no layer has one)."""
    if windows is None:
        return layers
    return eqx.tree_at(
        lambda b: b.attention.window, layers, jnp.asarray(windows, jnp.int32).reshape(shape)
    )


FAMILY = Family(name="decoder", config_class=DecoderConfig, model_class=DecoderLM, hf=None)
