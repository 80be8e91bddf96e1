"""Rotary position embeddings (the rotate-half layout of Llama, Mistral, Qwen, Gemma) with the
frequency scalings Hugging Face models use: ``linear`` (position interpolation), ``dynamic``
(NTK-aware, growing with the sequence), ``llama3`` (Llama 3.1's band-wise interpolation) and
``yarn`` (YaRN: a ramp between interpolated and original frequencies, plus an amplitude on
cos and sin, `rope_amplitude`; DeepSeek-V2/V3, Qwen long-context).
"""

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqxzoo.typed_config import check_fields, refuse

RopeScalingKind = Literal["linear", "dynamic", "llama3", "yarn"]


def check_rotary_dim(dim: int, field: str) -> None:
    """Refuse an odd number of rotated features (rotary embeddings turn pairs); ``field``
    names the option that sets it."""
    if dim % 2:
        refuse(field, f"must be even for rotary embeddings, got {dim}")


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
    - ``yarn``: frequency ``i`` is ``(1 - r_i) f_i / factor + r_i f_i``, where the ramp ``r_i``
      falls from 1 to 0 between the dimensions that turn ``beta_fast`` and ``beta_slow``
      times over ``original_max_positions`` (their bounds rounded outwards unless
      ``truncate`` is False); cos and sin are multiplied by `rope_amplitude`
      (``attention_factor`` if set, else from ``mscale`` and ``mscale_all_dim``).
      DeepSeek's latent attention also scales its scores by ``yarn_mscale(factor,
      mscale_all_dim)^2`` when ``mscale_all_dim`` is set. The fields are those of
      transformers' ``_compute_yarn_parameters``; the other kinds ignore them.
    """

    kind: RopeScalingKind
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

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
        if self.kind == "yarn" and not 0 < self.beta_slow <= self.beta_fast:
            refuse(
                "beta_fast",
                f"must be >= beta_slow > 0, got {self.beta_slow} and {self.beta_fast}",
            )
        if self.attention_factor is not None and self.attention_factor <= 0:
            refuse("attention_factor", f"must be > 0 (or unset), got {self.attention_factor}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 mscale ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_amplitude(scaling: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by (transformers' ``attention_factor``).

    1 for every kind but ``yarn``; for ``yarn``, ``attention_factor`` if set, else
    ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` when both are set
    (and non-zero), else ``yarn_mscale(factor)``. A factor on both queries and keys scales
    the scores by its square: YaRN's softmax temperature.
    """
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


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
    if scaling.kind == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling)
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


def _yarn_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> Float[Array, " half"]:
    def correction_dim(rotations: float) -> float:
        """The dimension whose wavelength turns ``rotations`` times over the original context."""
        inverse_frequency = scaling.original_max_positions / (rotations * 2 * math.pi)
        return head_dim * math.log(inverse_frequency) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    wavelength_factors = theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    extrapolated = 1.0 / wavelength_factors
    interpolated = 1.0 / (scaling.factor * wavelength_factors)
    kept = 1 - ramp
    return interpolated * (1 - kept) + extrapolated * kept


def apply_rope(
    x: Float[Array, "*batch seq heads head_dim"],
    positions: Int[Array, "*#batch seq"],
    frequencies: Float[Array, " half"],
    amplitude: Float[Array, ""] | float = 1.0,
) -> Float[Array, "*batch seq heads head_dim"]:
    """Rotate each (i, i + head_dim/2) pair of features by ``position * frequencies[i]`` and
    scale it by ``amplitude`` (`rope_amplitude`: YaRN's, else 1). ``positions`` are one
    per token of the sequence, shared by the batch or per sequence (packed documents).

    The angles are computed in float32; the result has the input dtype.
    """
    angles = positions.astype(jnp.float32)[..., None] * frequencies
    cos = amplitude * jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[..., None, :]
    sin = amplitude * jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[..., None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
