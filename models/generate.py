"""Text generation with a KV cache: prefill, one-token decode steps, sampling filters.

    import jax, models
    new_tokens = models.generate(model, prompt, max_new_tokens=32, temperature=0.8,
                                 top_p=0.9, key=jax.random.key(0))

`generate` is jitted and its loop is a `jax.lax.while_loop`, so it compiles once per prompt
length, ``max_new_tokens`` and sampling settings. One sequence per call; batch equal-length
prompts with `jax.vmap`. For a custom loop, drive `prefill` and `decode_step` directly on a
`KVCache` from `DecoderLM.init_cache`.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxzoo.typed_config import refuse
from models.decoder import DecoderLM, KVCache


def prefill(
    model: DecoderLM, prompt: Int[Array, " prompt"], cache: KVCache
) -> tuple[Float[Array, "prompt vocab"], KVCache]:
    """Run ``prompt`` through the model at positions ``cache.position, ...``, filling the cache.

    Returns the logits at every prompt position (the last one predicts the first new token).
    Calling it again with the next chunk continues the sequence (chunked prefill).
    """
    return model.cached_forward(prompt, cache)


def decode_step(
    model: DecoderLM, token: Int[Array, ""], cache: KVCache
) -> tuple[Float[Array, " vocab"], KVCache]:
    """Append one ``token`` at ``cache.position``; the logits predict the token after it."""
    logits, cache = model.cached_forward(token[None], cache)
    return logits[0], cache


def top_k_filter(logits: Float[Array, " vocab"], k: int) -> Float[Array, " vocab"]:
    """``logits`` with all but the ``k`` largest set to ``-inf`` (exactly ``k`` kept)."""
    values, indices = jax.lax.top_k(logits, k)
    return jnp.full_like(logits, -jnp.inf).at[indices].set(values)


def top_p_filter(logits: Float[Array, " vocab"], p: float) -> Float[Array, " vocab"]:
    """Nucleus filter: keep the smallest set of most probable tokens whose mass is ``>= p``.

    Tokens are taken in order of decreasing probability (ties by index) while the mass of
    those already taken is ``< p``; the rest are set to ``-inf``. The most probable token is
    always kept.
    """
    order = jnp.argsort(-logits, stable=True)
    sorted_probs = jax.nn.softmax(logits[order].astype(jnp.float32))
    mass_before = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(sorted_probs)[:-1]])
    keep = jnp.zeros(logits.shape, bool).at[order].set(mass_before < p)
    return jnp.where(keep, logits, -jnp.inf)


def sample_token(
    logits: Float[Array, " vocab"],
    key: PRNGKeyArray,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Int[Array, ""]:
    """One token from ``logits``: the argmax if ``temperature == 0``, else a sample.

    Sampling divides the logits by ``temperature``, then keeps the ``top_k`` most likely
    tokens, then the nucleus of mass ``top_p`` among those (the Hugging Face order).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        logits = top_k_filter(logits, min(top_k, logits.shape[-1]))
    if top_p is not None and top_p < 1:
        logits = top_p_filter(logits, top_p)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def check_sampling(
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    max_new_tokens: int | None = None,
) -> None:
    """Raise a `ConfigError` about the first setting out of range (its ``field`` is the
    argument's name; ``pipelines.generate`` reports it as the option's): the one check of the
    sampling options, for the library and the command alike."""
    if max_new_tokens is not None and max_new_tokens < 1:
        refuse("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        refuse("temperature", f"must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        refuse("top_k", f"must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        refuse("top_p", f"must be in (0, 1], got {top_p}")


@eqx.filter_jit
def generate(
    model: DecoderLM,
    prompt: Int[Array, " prompt"],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token: int | None = None,
    key: PRNGKeyArray,
) -> Int[Array, " new"]:
    """Continue ``prompt`` by ``max_new_tokens`` tokens (the prompt is not returned).

    Prefills a `KVCache` of ``prompt + max_new_tokens - 1`` positions, then alternates
    `sample_token` and `decode_step`; step ``i`` samples with ``jax.random.split(key,
    max_new_tokens)[i]``, so a key gives the same tokens every call. ``temperature=0`` is
    greedy (``top_k``/``top_p`` then do nothing). With ``stop_token`` the loop ends once it
    is sampled and the remaining positions hold ``stop_token``.
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if prompt.shape[0] < 1:
        raise ValueError("prompt must hold at least one token (e.g. a beginning-of-text token)")

    def sample(logits, step_key):
        return sample_token(logits, step_key, temperature=temperature, top_k=top_k, top_p=top_p)

    step_keys = jax.random.split(key, max_new_tokens)
    cache = model.init_cache(prompt.shape[0] + max_new_tokens - 1)
    logits, cache = prefill(model, prompt, cache)
    first = sample(logits[-1], step_keys[0])
    filler = 0 if stop_token is None else stop_token
    tokens = jnp.full((max_new_tokens,), filler, jnp.int32).at[0].set(first)

    def unfinished(state):
        index, token, _, _ = state
        if stop_token is None:
            return index < max_new_tokens
        return (index < max_new_tokens) & (token != stop_token)

    def next_token(state):
        index, token, cache, tokens = state
        logits, cache = decode_step(model, token, cache)
        token = sample(logits, step_keys[index])
        return index + 1, token, cache, tokens.at[index].set(token)

    _, _, _, tokens = jax.lax.while_loop(
        unfinished, next_token, (jnp.ones((), jnp.int32), first, cache, tokens)
    )
    return tokens
