"""The shared decoder-LM builder every family is assembled with.

`DecoderLM` fulfils the model contract (`eqxzoo.nn.LanguageModel`): ``embed``, an optional
``prefix``, the stacked ``blocks``, ``head``, and ``block_keys`` / ``make_layers`` so the
trainer can create the blocks directly in its pipeline layout. A family is a
`models.config.DecoderConfig` subclass plus its Hugging Face mapping (`models.family`);
the builder reads only the config's fields.
"""

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
    make_layers_for_keys,
    summarize_layer_aux,
)
from models.config import DecoderConfig
from models.family import Family


def make_norm(config: DecoderConfig) -> RMSNorm | LayerNorm:
    if config.norm == "rms":
        return RMSNorm(config.d_model, eps=config.norm_eps)
    return LayerNorm(config.d_model, eps=config.norm_eps)


class KVCache(eqx.Module):
    """Every layer's attention keys and values for the first ``position`` tokens of a sequence.

    Stacked on a leading ``layers`` axis like the blocks, so a decode step is one
    `jax.lax.scan` over layers and cache together; ``max_len`` rows per layer whatever the
    position, so decoding compiles once. Rows at and after ``position`` are not yet written
    (attention masks them). Keys are stored rotated (RoPE at their absolute positions).
    Build one with `DecoderLM.init_cache`; batch with `jax.vmap`.
    """

    keys: Float[Array, "layers max_len kv_heads head_dim"]
    values: Float[Array, "layers max_len kv_heads head_dim"]
    position: Int[Array, ""]

    @property
    def max_len(self) -> int:
        return self.keys.shape[1]


class DecoderBlock(eqx.Module):
    """Pre-norm residual block: ``h + attention(norm(h))``, then ``h + mlp(norm(h))``.

    ``mlp`` is a dense `MLP` or a `MoE`; the block returns ``(h, aux)`` with the MoE's
    per-layer auxiliary values (empty for dense blocks).
    """

    attention_norm: RMSNorm | LayerNorm
    attention: CausalSelfAttention
    mlp_norm: RMSNorm | LayerNorm
    mlp: MLP | MoE

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray):
        attention_key, mlp_key = jax.random.split(key)
        self.attention_norm = make_norm(config)
        self.attention = CausalSelfAttention(
            config.d_model,
            config.n_heads,
            config.kv_heads,
            config.attention_head_dim,
            rope_theta=config.rope_theta,
            qkv_bias=config.qkv_bias,
            qk_norm=config.qk_norm,
            norm_eps=config.norm_eps,
            init_std=config.init_std,
            key=attention_key,
        )
        self.mlp_norm = make_norm(config)
        moe = config.moe
        if moe is None:
            self.mlp = MLP(
                config.d_model,
                config.mlp_dim,
                activation=config.activation,
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

    def __call__(
        self, h: Float[Array, "*batch seq embed"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "*batch seq embed"], dict[str, Array]]:
        h = h + self.attention(self.attention_norm(h))
        if isinstance(self.mlp, MoE):
            mlp_out, aux = self.mlp(self.mlp_norm(h))
        else:
            mlp_out, aux = self.mlp(self.mlp_norm(h)), {}
        return h + mlp_out, aux

    def cached_forward(
        self,
        h: Float[Array, "seq embed"],
        keys: Float[Array, "max_len kv_heads head_dim"],
        values: Float[Array, "max_len kv_heads head_dim"],
        start: Int[Array, ""],
    ) -> tuple[
        Float[Array, "seq embed"],
        Float[Array, "max_len kv_heads head_dim"],
        Float[Array, "max_len kv_heads head_dim"],
    ]:
        """The block on tokens at positions ``start, ...`` against this layer's cache.

        Returns the hidden states and the cache with these tokens' keys and values written.
        A MoE routes each token as its own one-token sequence: routing is per token, as in
        the full pass, and no expert capacity can drop a token (a capacity-routed model
        decodes as if dropless; its full pass agrees wherever that drops nothing).
        """
        attended, keys, values = self.attention.cached_forward(
            self.attention_norm(h), keys, values, start
        )
        h = h + attended
        if isinstance(self.mlp, MoE):
            mlp_out, _ = self.mlp(self.mlp_norm(h)[:, None, :])
            mlp_out = mlp_out[:, 0, :]
        else:
            mlp_out = self.mlp(self.mlp_norm(h))
        return h + mlp_out, keys, values


class DecoderLM(eqx.Module):
    """A decoder-only language model: ``embed``, an optional ``prefix``, stacked ``blocks``,
    ``head`` (the model contract, `eqxzoo.nn.LanguageModel`).

    The parts can be driven separately (the pipeline runs ``blocks`` stage by stage between
    ``embed`` and ``head``); ``__call__`` composes them for one sequence. ``prefix`` is the
    contract's slot for first layers whose shapes differ from the block (None for every
    family so far; the KV-cache path does not run one yet). Batch with
    `jax.vmap`. The parts also take leading batch axes directly, with the same results as
    `jax.vmap` (the trainer uses this: token-flattened matmuls are faster than vmapped ones).
    ``config`` is kept (static) so the model can be saved and rebuilt.
    """

    embedding: Embedding
    prefix: Stack | None
    blocks: Stack
    final_norm: RMSNorm | LayerNorm
    unembedding: Linear | None
    config: DecoderConfig = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray):
        embed_key, blocks_key, head_key = jax.random.split(key, 3)
        self.embedding = Embedding(
            config.vocab_size, config.d_model, init_std=config.init_std, key=embed_key
        )
        self.prefix = None
        self.blocks = Stack(
            lambda layer_key: DecoderBlock(config, key=layer_key),
            config.n_layers,
            scan=config.scan_layers,
            remat_policy=config.remat,
            key=blocks_key,
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

    def embed(self, tokens: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq embed"]:
        return self.embedding(tokens)

    def block_keys(self, key: PRNGKeyArray) -> Key[Array, " layers"]:
        """The ``(n_layers,)`` keys ``DecoderLM(config, key=key)`` builds its blocks from."""
        _, blocks_key, _ = jax.random.split(key, 3)
        return jax.random.split(blocks_key, self.config.n_layers)

    def make_layers(self, layer_keys: Key[Array, "*stack"]) -> DecoderBlock:
        """Blocks for ``layer_keys`` of any shape, stacked on its axes (``blocks.layers`` for
        ``block_keys(key)``)."""
        config = self.config
        return make_layers_for_keys(lambda key: DecoderBlock(config, key=key), layer_keys)

    def head(self, h: Float[Array, "*batch seq embed"]) -> Float[Array, "*batch seq vocab"]:
        h = self.final_norm(h)
        if self.unembedding is None:
            return self.embedding.attend(h)
        return self.unembedding(h)

    def __call__(
        self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "seq vocab"], dict[str, Array]]:
        h = self.embed(tokens)
        if self.prefix is not None:
            h, _ = self.prefix(h)
        h, layer_aux = self.blocks(h, key=key)
        return self.head(h), summarize_layer_aux(layer_aux)

    def init_cache(self, max_len: int, dtype: DTypeLike | None = None) -> KVCache:
        """An empty `KVCache` of ``max_len`` positions (prompt plus generated tokens).

        ``dtype`` defaults to the embedding's (the parameter dtype).
        """
        config = self.config
        shape = (config.n_layers, max_len, config.kv_heads, config.attention_head_dim)
        dtype = self.embedding.weight.dtype if dtype is None else dtype
        return KVCache(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            position=jnp.zeros((), jnp.int32),
        )

    def cached_forward(
        self, tokens: Int[Array, " seq"], cache: KVCache
    ) -> tuple[Float[Array, "seq vocab"], KVCache]:
        """Logits of ``tokens`` continuing the cached sequence, and the cache extended by them.

        ``tokens`` sit at positions ``cache.position, ...``; the logits equal those rows of
        ``self(whole_sequence)[0]``. A prompt goes through in one call (prefill), then one
        token per call (decode). The layers run as one `jax.lax.scan` over the stacked blocks
        and the stacked cache. Overflowing ``cache.max_len`` is an error.
        """
        position = eqx.error_if(
            cache.position,
            cache.position + tokens.shape[0] > cache.max_len,
            "KVCache overflow: the tokens do not fit in max_len; build the cache larger",
        )
        params, static = eqx.partition(self.blocks.layers, eqx.is_array)

        def one_layer(h, layer):
            layer_params, keys, values = layer
            block = eqx.combine(layer_params, static)
            h, keys, values = block.cached_forward(h, keys, values, position)
            return h, (keys, values)

        h, (keys, values) = jax.lax.scan(
            one_layer, self.embed(tokens), (params, cache.keys, cache.values)
        )
        cache = KVCache(keys=keys, values=values, position=position + tokens.shape[0])
        return self.head(h), cache


FAMILY = Family(name="decoder", config_class=DecoderConfig, model_class=DecoderLM, hf=None)
