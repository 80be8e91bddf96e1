"""Rotary position embeddings (the rotate-half layout of Llama, Mistral, Qwen, Gemma) with the
frequency scalings Hugging Face models use: ``linear`` (position interpolation), ``dynamic``
(NTK-aware, growing with the sequence) and ``llama3`` (Llama 3.1's band-wise interpolation).
"""

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqxzoo.typed_config import check_fields, refuse

RopeScalingKind = Literal["linear", "dynamic", "llama3"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How a model stretches its rotary frequencies beyond the context it was trained at.

    - ``linear``: every frequency divided by ``factor``.
    - ``dynamic``: once a sequence is longer than ``original_max_positions`` (``T`` tokens),
      the base becomes ``theta * (factor T / original - factor + 1)^(d / (d - 2))``, recomputed
      as the sequence grows (transformers' ``dynamic``; shorter sequences are unscaled). As
      in transformers, a KV cache keeps each key rotated as it was when cached, so decoding
      past ``original_max_positions`` differs from recomputing the whole sequence.
    - ``llama3``: wavelengths longer than ``original_max_positions / low_freq_factor`` are
      divided by ``factor``, shorter than ``original_max_positions / high_freq_factor`` kept,
      and the band between interpolated smoothly.
    """

    kind: RopeScalingKind
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self):
        check_fields(self)
        if self.factor <= 0:
            refuse("factor", f"must be > 0, got {self.factor}")
        if self.original_max_positions < 1:
            refuse("original_max_positions", f"must be >= 1, got {self.original_max_positions}")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            refuse(
                "high_freq_factor",
                f"must exceed low_freq_factor > 0, got {self.low_freq_factor} and "
                f"{self.high_freq_factor}",
            )


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    seq_len: Int[Array, ""] | int | None = None,
) -> Float[Array, " half"]:
    """Inverse frequencies ``theta^(-2i/head_dim)`` for ``i < head_dim / 2``, then scaled.

    ``seq_len`` (the number of positions seen so far: the last position plus one) is what
    ``dynamic`` scaling depends on; the other kinds ignore it.
    """
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    if scaling is None or scaling.kind == "linear":
        factor = 1.0 if scaling is None else scaling.factor
        return 1.0 / (theta**exponents) / factor
    if scaling.kind == "dynamic":
        assert seq_len is not None, "dynamic rotary scaling depends on the sequence length"
        original = scaling.original_max_positions
        length = jnp.maximum(jnp.asarray(seq_len, jnp.float32), original)
        power = head_dim / (head_dim - 2)
        base = theta * (scaling.factor * length / original - (scaling.factor - 1)) ** power
        return 1.0 / (base**exponents)
    frequencies = 1.0 / (theta**exponents)
    original = scaling.original_max_positions
    wavelengths = 2 * math.pi / frequencies
    scaled = jnp.where(
        wavelengths > original / scaling.low_freq_factor, frequencies / scaling.factor, frequencies
    )
    smooth = (original / wavelengths - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelengths >= original / scaling.high_freq_factor) & (
        wavelengths <= original / scaling.low_freq_factor
    )
    return jnp.where(medium, smoothed, scaled)


def apply_rope(
    x: Float[Array, "*batch seq heads head_dim"],
    positions: Int[Array, " seq"],
    frequencies: Float[Array, " half"],
) -> Float[Array, "*batch seq heads head_dim"]:
    """Rotate each (i, i + head_dim/2) pair of features by ``position * frequencies[i]``.

    The angles are computed in float32; the result has the input dtype.
    """
    angles = positions.astype(jnp.float32)[:, None] * frequencies[None, :]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
