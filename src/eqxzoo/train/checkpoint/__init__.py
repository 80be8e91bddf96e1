"""Checkpoints: orbax `CheckpointManager`, async, keep-N, one Composite per step.

Every checkpoint holds three items:

- ``state``: the `TrainState` arrays (step, model in the pipeline layout, optimizer state),
  written with ``StandardSave`` and restored onto the *caller's* target shardings, so a
  run can resume on a different mesh;
- ``data``: the data iterator's ``get_state()`` dict as ``process_{i}-of-{n}.json`` files
  (grain's format), read back even when the number of processes changed;
- ``meta``: a JSON dict (run config, seed, counters such as skipped updates).

Restoring walks back from the newest checkpoint, telling damage from a failure to read
(`damage`): a damaged one (arrays or data state that do not match their checksums, a file
truncated or deleted, its metadata missing) is moved aside to ``damaged-STEP``, reported in
one line, and the one before is tried; any other failure (an I/O error, a permission,
memory) stops the restore in one line and moves or deletes nothing, and so does a checkpoint
whose arrays are not those of the state restored into it (`check_shapes`: a config or code
that builds another model, named by an array and both shapes, not in orbax's words). The
run never deletes a checkpoint: ``keep`` only removes the oldest. orbax writes a step under a
temporary name and renames it when complete, so a save killed half-way is never listed as a
checkpoint.

A save that cannot be written (no space left, a quota, an I/O error) is one
`CheckpointError` naming the step, the cause and the newest good checkpoint, raised once the
save's other writes have ended; its partial temporary directory is removed and the earlier
checkpoints are untouched. Before each save, a free space smaller than the last checkpoint's
size is warned about. orbax's own reports of a failed write (its threads' error logs) are
silenced: the failure reaches the caller as that one error.

The parts: `manager` (the `Checkpointer`), `data_state` (the iterator item), `checksums`
(what a restored array and data state must be), `damage` (damage or a failure to read),
`orbax_failures` (a failed write in one line), `errors`.
"""

from eqxzoo.train.checkpoint.checksums import CHECKSUMS, Inspection, inspect_arrays, verify_arrays
from eqxzoo.train.checkpoint.data_state import DataStateHandler
from eqxzoo.train.checkpoint.errors import (
    CheckpointDamaged,
    CheckpointError,
    CheckpointMismatch,
    CheckpointUnreadable,
    CheckpointWarning,
)
from eqxzoo.train.checkpoint.manager import (
    ASYNC_SAVE_GB,
    ITEMS,
    STEP_METADATA_FILE,
    SYNC_SAVE_GB,
    TMP_SUFFIX,
    Checkpointer,
    Damaged,
    Restored,
    check_complete,
    check_shapes,
    finished_steps,
    saves_asynchronously,
)
from eqxzoo.train.checkpoint.orbax_failures import SETTLE_SECONDS

__all__ = [
    "ASYNC_SAVE_GB",
    "CHECKSUMS",
    "ITEMS",
    "SETTLE_SECONDS",
    "STEP_METADATA_FILE",
    "SYNC_SAVE_GB",
    "TMP_SUFFIX",
    "CheckpointDamaged",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointUnreadable",
    "CheckpointWarning",
    "Checkpointer",
    "Damaged",
    "DataStateHandler",
    "Inspection",
    "Restored",
    "check_complete",
    "check_shapes",
    "finished_steps",
    "inspect_arrays",
    "saves_asynchronously",
    "verify_arrays",
]
