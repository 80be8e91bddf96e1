"""Packed documents: several documents in one sequence that must not see each other.

A training window packs documents one after another. `Documents` tells the attention which
tokens belong together (a query sees only earlier keys of its own segment) and where each
token sits in its own document (rotary and learned position embeddings restart at 0 per
document), so that a packed sequence computes what each document would alone.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int


class Documents(eqx.Module):
    """``segments``: equal ids for the tokens of one document (ids differ between the
    documents of a sequence); ``positions``: each token's position in its document. Both
    ``(*batch, seq)``, laid out like the tokens (a context-parallel shard holds its tokens'
    own)."""

    segments: Int[Array, "*batch seq"]
    positions: Int[Array, "*batch seq"]

    def __getitem__(self, index) -> "Documents":
        """The documents of ``tokens[index]`` (an index into the leading axes)."""
        return jax.tree.map(lambda a: a[index], self)


def documents_of(segments: Int[Array, "*batch seq"]) -> Documents:
    """`Documents` from segment ids whose documents are contiguous runs: each token's position
    counts from the first token of its run."""
    index = jnp.arange(segments.shape[-1], dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones_like(segments[..., :1], bool), segments[..., 1:] != segments[..., :-1]], axis=-1
    )
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=segments.ndim - 1)
    return Documents(segments=segments.astype(jnp.int32), positions=index - first)
