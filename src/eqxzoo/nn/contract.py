"""The model contract: what the trainer, the pipeline and the checkpoints need of a model.

The trainer never depends on a model class. A model is any Equinox module with these parts,
driven separately by the pipeline (embedding and head outside it, the stacked blocks staged
over ``pp`` inside it):

- ``embed(tokens, positions=None) -> h``: token ids ``(*batch, seq)`` to hidden states
  ``(*batch, seq, embed)``; ``positions`` (default ``0, 1, ...``) where the tokens sit, for
  models with learned position embeddings (a sequence split for context parallelism; per
  sequence, each token's position in its document, for packed documents).
- ``prefix``: a `Stack` of the few first layers whose shapes differ from the repeated block
  (DeepSeek's dense first layers), run outside the pipeline after ``embed``; ``None`` for
  most models. Its layers return no auxiliary values.
- ``blocks``: one `Stack` of identical layers, every array with a leading ``layers`` axis;
  each layer is called as ``layer(h, key=None) -> (h, aux)`` on ``(*batch, seq, embed)``.
  ``blocks.remat_policy`` is how each layer is rematerialised. Batches of packed documents
  call it (and the prefix's layers) with ``documents=`` (`eqxzoo.nn.Documents`) as well: a
  model trained on them takes that keyword; one that is not never sees it.
- ``head(h) -> logits``: hidden states to ``(*batch, seq, vocab)`` logits, and
  ``head_inputs(h) -> HeadInputs``: what ``head`` makes them of, so that the trainer's loss
  can compute them chunk by chunk (`eqxzoo.nn.fused_cross_entropy`) instead of all at once.
- ``block_keys(key)``: the per-layer keys that ``Model(..., key=key)`` builds its blocks from,
  shape ``(layers,)``, and ``make_layers(layer_keys)``: the layers for those keys reshaped to
  any leading axes (layer order kept), stacked on those axes. With both, the trainer creates
  the blocks directly in the pipeline's ``[repeats, stages, layers per stage]`` layout, value
  for value the same as the model's own initialisation.
- What differs between layers is integer *data* inside the blocks (a sliding window per
  layer), stacked like the weights: it is staged, sharded and checkpointed with them, and
  never differentiated or updated (only floating arrays are parameters).
- ``__call__(tokens, *, key=None) -> (logits, aux)`` for one sequence: the composition,
  with ``aux`` the per-layer auxiliary values reduced by `summarize_layer_aux` (and
  ``documents=`` for packed documents, as the layers).

Every array is annotated with logical axes (`eqxzoo.nn.AbstractAxesOwner`).
"""

from typing import NamedTuple, Protocol, runtime_checkable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray, PyTree

from eqxzoo.nn.cross_entropy import Unembedding
from eqxzoo.nn.stack import Stack


class HeadInputs(NamedTuple):
    """What a model's ``head`` makes its logits of: ``softcap * tanh(features @ projection /
    softcap)`` (no cap where ``softcap`` is None).

    ``projection`` is the ``(embed, vocab)`` output projection, or with ``vocab_major`` a tied
    ``(vocab, embed)`` embedding table, read as it is stored: transposing it for the loss
    would cost a copy of the table and of its gradient.
    """

    features: Float[Array, "*batch seq embed"]
    projection: Unembedding
    vocab_major: bool
    softcap: float | None


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder LM the trainer can pipeline; see the module docstring."""

    prefix: Stack | None
    blocks: Stack

    def embed(
        self, tokens: Int[Array, "*batch seq"], positions: Int[Array, "*#batch seq"] | None = None
    ) -> Float[Array, "*batch seq embed"]: ...

    def head(self, h: Float[Array, "*batch seq embed"]) -> Float[Array, "*batch seq vocab"]: ...

    def head_inputs(self, h: Float[Array, "*batch seq embed"]) -> HeadInputs: ...

    def block_keys(self, key: PRNGKeyArray) -> Key[Array, " layers"]: ...

    def make_layers(self, layer_keys: Key[Array, "*stack"]) -> PyTree: ...

    def __call__(
        self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "seq vocab"], dict[str, Array]]: ...


def make_layers_for_keys(make_layer, layer_keys: Key[Array, "*stack"]) -> PyTree:
    """``make_layer`` (one key -> one layer) over every key of ``layer_keys``, the layers'
    arrays stacked on the keys' leading axes (one `eqx.filter_vmap` per axis)."""
    build = make_layer
    for _ in range(layer_keys.ndim):
        build = eqx.filter_vmap(build)
    return build(layer_keys)


def summarize_layer_aux(layer_aux: dict[str, Array]) -> dict[str, Array]:
    """Reduce per-layer aux values (leading ``layers`` axis) to the model's ``aux``.

    Losses and the dropped and padding fractions are averaged over layers; the per-expert
    values (``expert_fraction``, ``expert_assignments``, ``router_probability``) keep their
    ``(layers, experts)`` shape.
    """
    return {
        name: values if values.ndim > 1 else jnp.mean(values, axis=0)
        for name, values in layer_aux.items()
    }


def layer_means(aux: dict[str, Array]) -> dict[str, Array]:
    """The model's ``aux`` (`summarize_layer_aux`) with every value averaged over layers,
    the per-expert ones too."""
    return {
        name: values if values.ndim < 2 else jnp.mean(values, axis=0)
        for name, values in aux.items()
    }
