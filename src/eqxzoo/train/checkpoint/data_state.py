"""The data iterator item of a checkpoint: each process's iterator state as grain's
``process_{i}-of-{n}.json``, read back even when the number of processes changed."""

import dataclasses
import json
import re

import jax
import orbax.checkpoint as ocp
from etils import epath

from eqxzoo.train.checkpoint.errors import CheckpointDamaged

_DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def process_index_and_count() -> tuple[int, int]:
    """``(process index, process count)`` of this JAX process: names its data state file."""
    return jax.process_index(), jax.process_count()


def data_state_file(index: int, count: int) -> str:
    """grain's file name for one process's iterator state."""
    return f"process_{index}-of-{count}.json"


class DataStateHandler(ocp.CheckpointHandler):
    """Saves an iterator state dict as ``process_{i}-of-{n}.json``, the file grain writes.

    The state is the global position in the example order, identical on every process, so
    when a checkpoint written by ``m`` processes is restored by ``n != m`` processes each of
    them reads process 0's file. With the same count, each process reads its own file and
    a missing one is an error (the checkpoint is incomplete).
    """

    def save(self, directory: epath.Path, args: ocp.args.CheckpointArgs) -> None:
        index, count = process_index_and_count()
        (directory / data_state_file(index, count)).write_text(json.dumps(args.state, indent=4))

    def restore(self, directory: epath.Path, args: ocp.args.CheckpointArgs | None = None) -> dict:
        index, count = process_index_and_count()
        own = directory / data_state_file(index, count)
        if own.exists():
            return _read_data_state(own)
        counts = {
            int(match.group(2))
            for path in directory.iterdir()
            if (match := _DATA_FILE.fullmatch(path.name))
        }
        if not counts:
            raise CheckpointDamaged(
                "no data iterator state (process_*-of-*.json) in the checkpoint"
            )
        if count in counts or len(counts) > 1:
            raise CheckpointDamaged(f"data iterator state {own.name} is missing")
        (saved_count,) = counts
        first = directory / data_state_file(0, saved_count)
        if not first.exists():
            raise CheckpointDamaged(f"data iterator state {first.name} is missing")
        return _read_data_state(first)

    def metadata(self, directory: epath.Path) -> None:
        return None

    def close(self) -> None:
        pass


def _read_data_state(path: epath.Path) -> dict:
    state = json.loads(path.read_text())
    if not isinstance(state, dict):
        raise CheckpointDamaged("the iterator state is not a JSON object")
    return state


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    pass
