"""What a checkpoint's arrays must be: finite, and bit for bit what was saved (two checksums
per array, independent of how it is sharded)."""

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from eqxzoo.train.checkpoint.errors import CheckpointDamaged

CHECKSUMS = "checksums"  # the key of the arrays' checksums in the meta item
DATA_CHECKSUM = "data_checksum"  # and of the data iterator state's


def data_state_checksum(data_state: dict) -> str:
    """The SHA-256 of the iterator state's canonical JSON (the same on every process: the
    state is the global position in the example order)."""
    text = json.dumps(data_state, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def verify_data_state(data_state: dict, checksum: str | None) -> None:
    """Raise `CheckpointDamaged` if a restored iterator state is not the one saved (those
    written before the checksum existed have none to compare)."""
    if checksum is not None and data_state_checksum(data_state) != checksum:
        raise CheckpointDamaged(
            "data: the iterator state does not match its checksum: the file was changed after "
            "it was written"
        )


def verify_arrays(state: PyTree, checksums: dict[str, list[int]] | None) -> None:
    """Raise `CheckpointDamaged` if a restored array is not what was saved (its checksum differs;
    checkpoints written before checksums existed have none to compare) or holds NaN/Inf."""
    inspection = inspect_arrays(state)
    if checksums is not None:
        damaged = [
            path for path, sums in inspection.checksums.items() if checksums.get(path) != sums
        ]
        if damaged:
            more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
            raise CheckpointDamaged(
                f"state: {damaged[0]}{more} does not match its checksum: the files were "
                "damaged after they were written"
            )
    if inspection.non_finite:
        raise CheckpointDamaged(f"state: non-finite values in {inspection.non_finite[0]}")


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What `inspect_arrays` found in a state: per array path (``.model.embedding.weight``),
    whether its values are all finite (integer arrays are) and its checksum."""

    finite: dict[str, bool]
    checksums: dict[str, list[int]]

    @property
    def non_finite(self) -> list[str]:
        return [path for path, ok in self.finite.items() if not ok]


def inspect_arrays(state: PyTree) -> Inspection:
    """Check every array of ``state`` for NaN/Inf and checksum it, in one compiled pass.

    The checksum of an array is two sums (mod 2^32) over its values' bits, as unsigned
    words: their plain sum, which any single flipped bit changes, and a sum weighted by each
    word's position, which catches words moved around. Both are sums of integers, so they do
    not depend on how the array is sharded: a checkpoint restored onto another mesh gives
    the same checksums.
    """
    leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(state)
    arrays = [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in leaves_with_paths
        if isinstance(leaf, jax.Array | np.ndarray)
        and (jnp.issubdtype(leaf.dtype, jnp.number) or leaf.dtype == jnp.bool_)
        and leaf.dtype.itemsize in (1, 2, 4)
    ]
    if not arrays:
        return Inspection({}, {})
    finite, sums = jax.device_get(_inspect(tuple(leaf for _, leaf in arrays)))
    paths = [path for path, _ in arrays]
    return Inspection(
        finite=dict(zip(paths, map(bool, finite), strict=True)),
        checksums={path: [int(a), int(b)] for path, (a, b) in zip(paths, sums, strict=True)},
    )


@jax.jit
def _inspect(leaves):
    finite, sums = [], []
    for leaf in leaves:
        finite.append(
            jnp.all(jnp.isfinite(leaf)) if jnp.issubdtype(leaf.dtype, jnp.inexact) else True
        )
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]
        bits = leaf.astype(jnp.uint8) if leaf.dtype == jnp.bool_ else leaf
        words = jax.lax.bitcast_convert_type(bits, unsigned).astype(jnp.uint32)
        sums.append(jnp.stack([jnp.sum(words), jnp.sum(words * _positions(words.shape))]))
    return jnp.stack(finite), jnp.stack(sums)


def _positions(shape: tuple[int, ...]) -> Array:
    """``1 +`` each element's row-major position (mod 2^32), built in the array's own shape:
    flattening a sharded array to number its words made XLA gather it whole onto every
    device (a 1 GB embedding on 8 CPU devices ran the host out of memory at a save)."""
    position = jnp.ones(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        position = position + index * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return position
