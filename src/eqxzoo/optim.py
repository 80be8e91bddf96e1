"""Filtered optax: trainable/frozen partition, decay mask, global-norm clip, warmup-cosine.

The optimizer runs on global arrays outside any `shard_map`, so `clip_by_global_norm` sees
the norm of the whole gradient, never one device's slice of it.
"""

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

import jax
import optax
from jaxtyping import PyTree

from eqxzoo.nn.parameters import is_parameter
from eqxzoo.typed_config import check_fields, identity_field, refuse, runtime_field


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (or Adafactor) on a warmup-cosine schedule after a global-norm clip.

    The learning rate rises linearly from 0 to ``learning_rate`` over ``warmup_steps``, then
    follows a cosine down to ``learning_rate * final_lr_fraction`` at ``decay_steps``.
    ``clip_norm = 0`` disables clipping. ``freeze`` lists regular expressions matched
    against parameter paths (``.blocks.layers.attention.wq``); matches get no optimizer
    state and never change.
    """

    name: Literal["adamw", "adafactor"] = identity_field("adamw")
    learning_rate: float = runtime_field(3e-4)
    warmup_steps: int = runtime_field(100)
    decay_steps: int = runtime_field(10_000)
    final_lr_fraction: float = runtime_field(0.1)
    b1: float = runtime_field(0.9)
    b2: float = runtime_field(0.95)
    eps: float = runtime_field(1e-8)
    weight_decay: float = runtime_field(0.1, off_at_zero=True)
    clip_norm: float = runtime_field(1.0, off_at_zero=True)
    freeze: tuple[str, ...] = identity_field(())

    def __post_init__(self):
        check_fields(self)
        if self.learning_rate <= 0:
            refuse("learning_rate", f"must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_steps < self.decay_steps:
            refuse(
                "warmup_steps",
                f"must be in [0, decay_steps={self.decay_steps}), got {self.warmup_steps}",
            )
        if self.clip_norm < 0:
            refuse("clip_norm", f"must be >= 0 (0: off), got {self.clip_norm}")
        for pattern in self.freeze:
            try:
                re.compile(pattern)
            except re.error as error:
                refuse("freeze", f"bad pattern {pattern!r}: {error}")


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=config.decay_steps,
        end_value=config.learning_rate * config.final_lr_fraction,
    )


_NO_DECAY = re.compile(r"(norm|bias|sinks|\.b[qkv]\b)")


def decay_mask(params: PyTree) -> PyTree[bool]:
    """True for parameters that get weight decay: everything but norms, biases and attention
    sinks (a bias of each head's softmax)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _NO_DECAY.search(jax.tree_util.keystr(path)) is None, params
    )


def trainable_mask(model: PyTree, freeze: Sequence[str] = ()) -> PyTree[bool]:
    """True for the parameters (`eqxzoo.nn.parameters.is_parameter`: floating arrays, less
    the buffers) whose path matches none of the ``freeze`` patterns."""
    patterns = [re.compile(p) for p in freeze]

    def trainable(path, leaf):
        name = jax.tree_util.keystr(path)
        return is_parameter(path, leaf) and not any(p.search(name) for p in patterns)

    return jax.tree_util.tree_map_with_path(trainable, model)


def build_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm`` then AdamW with `decay_mask` (or Adafactor), on the schedule."""
    schedule = learning_rate_schedule(config)
    if config.name == "adamw":
        update = optax.adamw(
            schedule,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask,
        )
    else:
        update = optax.adafactor(
            schedule, weight_decay_rate=config.weight_decay or None, weight_decay_mask=decay_mask
        )
    if config.clip_norm == 0:
        return update
    return optax.chain(optax.clip_by_global_norm(config.clip_norm), update)
