"""Checkpoint writes that fail as a full disk, a quota or an I/O error makes them fail, forced
for the tests: each fake stands in for the lowest orbax function that reaches the filesystem
for one part of a save and raises what that function raises there, at a chosen moment.

TensorStore writes an item's arrays concurrently (one `asyncio.gather` of their writes, run on
an event loop of an orbax thread). When the disk fills up, one write fails first and the others
are already in TensorStore's hands: they fail too, and each outcome is delivered into the event
loop from TensorStore's own thread, whenever that write ends (``call_soon_threadsafe``). The
fakes reproduce that timing: the first write of the step fails at once; the failure of every
other one is delivered at the moment the loop's coroutine ends (the race CI lost: the loop
stops before the tasks waiting for those writes run) and, in any case, `LATE` seconds later,
when TensorStore also writes that array's file (creating the directories it needs, as its
``file`` driver does).
"""

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

from orbax.checkpoint._src.serialization import jax_array_handlers, serialization

from eqxzoo.train.checkpoint import TMP_SUFFIX

LATE = 0.3  # seconds TensorStore takes to end the other writes of a failed one


def tensorstore_error(code: int, key: str, directory: str) -> ValueError:
    """The exception TensorStore raises when the operating system refuses one of its writes:
    every failed status becomes a `ValueError`, and the errno is carried in the text."""
    return ValueError(
        f'RESOURCE_EXHAUSTED: Error writing "{key}/0" in OCDBT database at local file '
        f'"{directory}": Failed writing: "{directory}d/0f3a": Failed to write 24579 bytes to '
        f"file 10: {os.strerror(code)} [os_error_code='{code}']"
    )


def in_step(path: str | os.PathLike, step: int) -> bool:
    """Whether ``path`` lies in the temporary directory of the save of ``step``."""
    return f"{os.sep}{step}{TMP_SUFFIX}" in os.fspath(path)


def refused(code: int, path: str | os.PathLike) -> OSError:
    """The exception Python raises when the operating system refuses a write with ``code``."""
    return OSError(code, os.strerror(code), os.fspath(path))


class FailingArrayWrites:
    """`serialization.async_serialize_from_host` (one array's write) for the save of ``step``:
    the first write fails with TensorStore's error ``code``; the others fail as described in
    the module's docstring. Other steps are written for real. `wait` joins TensorStore's
    (simulated) threads."""

    def __init__(self, code: int, step: int):
        self.code = code
        self.step = step
        self.failed = False
        self.threads: list[threading.Thread] = []
        self.real = serialization.async_serialize_from_host

    async def __call__(self, replica_slices, spec: dict, **kwargs) -> None:
        directory = spec["kvstore"]["base"]["path"]
        if not in_step(directory, self.step):
            return await self.real(replica_slices, spec, **kwargs)
        error = tensorstore_error(self.code, spec["kvstore"]["path"], directory)
        if not self.failed:
            self.failed = True
            raise error
        await self._in_flight(error, Path(directory, "d", spec["kvstore"]["path"]))

    def _in_flight(self, error: ValueError, file: Path) -> asyncio.Future:
        """A write TensorStore is already doing: its failure reaches the event loop when the
        loop's coroutine ends, or after `LATE` seconds, once the file is written."""
        loop = asyncio.get_running_loop()
        outcome = loop.create_future()

        def deliver(*_) -> None:
            if not outcome.done():
                outcome.set_exception(error)

        def end_write() -> None:
            time.sleep(LATE)
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(b"written by TensorStore after the first write failed")
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is told
                loop.call_soon_threadsafe(deliver)

        threading.current_thread().main_task.add_done_callback(deliver)  # orbax's run_sync
        thread = threading.Thread(target=end_write)  # which drops end_write once it ran
        self.threads.append(thread)
        thread.start()
        return outcome

    def wait(self) -> None:
        while self.threads:
            self.threads.pop().join()


class SlowArrayWrites:
    """`serialization.async_serialize_from_host` whose writes for the save of ``step`` start
    `LATE` seconds late (they are still running when another part of the save fails); `wait`
    returns once they are done."""

    def __init__(self, step: int):
        self.step = step
        self.pending = 0
        self.done = threading.Condition()
        self.real = serialization.async_serialize_from_host

    async def __call__(self, replica_slices, spec: dict, **kwargs) -> None:
        if not in_step(spec["kvstore"]["base"]["path"], self.step):
            return await self.real(replica_slices, spec, **kwargs)
        with self.done:
            self.pending += 1
        try:
            await asyncio.sleep(LATE)
            await self.real(replica_slices, spec, **kwargs)
        finally:
            with self.done:
                self.pending -= 1
                self.done.notify_all()

    def wait(self) -> None:
        with self.done:
            assert self.done.wait_for(lambda: self.pending == 0, timeout=30)


def failing_sharding_write(code: int, step: int):
    """`jax_array_handlers._async_serialize_shardings` (the ``_sharding`` file of the state
    item) failing with TensorStore's error ``code`` in the save of ``step``."""
    real = jax_array_handlers._async_serialize_shardings

    async def write(shardings, infos, **kwargs) -> None:
        directory = f"{infos[0].parent_dir}{os.sep}"
        if not in_step(directory, step):
            return await real(shardings, infos, **kwargs)
        raise tensorstore_error(code, "_sharding", directory)

    return write


def install_failing_array_writes(code: int, step: int) -> FailingArrayWrites:
    """Make the array writes of step ``step`` fail in this process (for a subprocess)."""
    writes = FailingArrayWrites(code, step)
    serialization.async_serialize_from_host = writes
    return writes
