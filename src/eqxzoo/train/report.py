"""What a run reports: peak FLOP/s and MFU, metrics files, progress, loss plot.

Everything here runs on the host on values already fetched from the devices; only process 0
writes (the loop decides), so none of it ever synchronises the processes.
"""

import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from eqxzoo.progress import terminal_console

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT_FILE = "loss.png"

# Dense bf16 peak FLOP/s per chip, by a substring of `jax.Device.device_kind`.
PEAK_FLOPS = {
    "B200": 2250e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v4": 275e12,
}


def measured_matmul_flops(repeats: int = 10, size: int = 1024) -> float:
    """FLOP/s of a jitted fp32 ``size x size`` matmul on the first device: the peak used for
    MFU where no table entry exists (CPUs). Simulated CPU devices share the host's cores,
    so this is the whole host's peak, not one device's. At 1024 it takes 0.7 s of a run's
    start on 2 cores and measures what 2048 does (72.9 against 72.8 GFLOP/s; 2048 took 3.3 s)."""
    a = jax.device_put(jax.random.normal(jax.random.key(0), (size, size)), jax.devices()[0])
    b = jax.device_put(jax.random.normal(jax.random.key(1), (size, size)), jax.devices()[0])
    matmul = jax.jit(jnp.matmul)
    return 2 * size**3 / median_seconds(lambda: matmul(a, b), repeats=repeats)


def median_seconds(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` (its outputs waited for) over ``repeats`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_flops(devices: Sequence[jax.Device]) -> tuple[float, str]:
    """The mesh's peak FLOP/s and where it came from (the table, or a measured matmul)."""
    kind = devices[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if name in kind:
            return flops * len(devices), f"{len(devices)} x {name} bf16 peak"
    return (
        measured_matmul_flops(),
        f"measured {devices[0].platform} matmul peak (whole host)",
    )


# ----------------------------------------------------------------------------- writers


class MetricsWriter:
    """Appends one JSON line per record to ``metrics.jsonl`` and mirrors scalars to TensorBoard
    (``tensorboard/``) and, if asked, Weights & Biases."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool,
        wandb_project: str | None,
        config: Mapping[str, Any],
        resume_from_step: int,
    ):
        self.path = run_dir / METRICS_FILE
        truncate_after(self.path, resume_from_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        self._tensorboard = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        self._wandb = None
        if wandb_project is not None:
            try:
                import wandb
            except ImportError:
                raise RuntimeError(
                    "run.wandb is on but wandb is not installed (pip install wandb)"
                ) from None
            self._wandb = wandb.init(
                project=wandb_project,
                config=dict(config),
                dir=str(run_dir),
                resume="allow",
            )

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = int(record["step"])
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` (a half-written last line is ignored)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def truncate_after(path: Path, step: int) -> None:
    """Drop records past ``step``: a resumed run rewrites the steps after its checkpoint, so
    the file holds one history, not the killed run's tail followed by its repeat."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    replace_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` as ``path`` aside, then rename it over: a disk that fills half-way leaves
    the file as it was, never half written."""
    partial = path.with_name(path.name + ".tmp")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


class ProgressBar:
    """Step, loss, tokens/s and ETA of a run; silent unless ``enabled`` (process 0).

    On a terminal: a rich progress bar redrawn at every step, with messages printed above it;
    it stops at the last step (or on `close`). Elsewhere (logs, CI, captured output): a plain
    line every ``every`` steps and at the last step, messages as plain lines. The live display
    redraws only when updated (no thread), leaves the cursor visible and redirects nothing, so
    a run that ends before the last step without `close` still leaves the terminal usable.
    """

    def __init__(
        self, total: int, *, every: int, stream: io.TextIOBase = sys.stderr, enabled: bool = True
    ):
        self.enabled = enabled
        self.total = total
        self.every = every
        self.stream = stream
        self.console = terminal_console(stream) if enabled else None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._closed = False

    def update(self, step: int, *, loss: float, tokens_per_s: float, seconds_per_step: float):
        if not self.enabled:
            return
        eta = format_seconds(seconds_per_step * (self.total - step))
        stats = f"loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | ETA {eta}"
        if self.console is None:
            self._print_line(step, stats)
        elif not self._closed:
            self._draw(step, stats)
            if step == self.total:
                self.close()

    def _print_line(self, step: int, stats: str) -> None:
        if step % self.every and step != self.total:
            return
        done = step / self.total
        width = 24
        bar = "#" * int(done * width) + "-" * (width - int(done * width))
        self.stream.write(f"step {step}/{self.total} [{bar}] {stats}\n")
        self.stream.flush()

    def _draw(self, step: int, stats: str) -> None:
        description = f"step {step:>{len(str(self.total))}}/{self.total}"  # fixed width
        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                TextColumn("{task.fields[stats]}", markup=False),
                console=self.console,
                auto_refresh=False,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._task = self._progress.add_task(
                description, total=self.total, completed=step, stats=stats
            )
            self._progress.start()
            # Live hides the cursor until stopped: show it again, so that a run stopped early
            # (an error, a signal) without close() does not leave the terminal without one.
            self._progress.console.show_cursor(True)
        else:
            assert self._task is not None
            self._progress.update(
                self._task, description=description, completed=step, stats=stats, refresh=True
            )

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.console is None:
            self.stream.write(text + "\n")
            self.stream.flush()
        else:
            self.console.print(text)  # above the bar while it is shown

    def close(self) -> None:
        """Stop the live display, leaving the bar as last drawn; safe to call again."""
        self._closed = True
        if self._progress is not None:
            self._progress.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def plot_losses(metrics_path: Path, png_path: Path, title: str) -> None:
    """Training loss (per step) and validation loss (per evaluation) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r.get("cross_entropy", r["loss"])) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    figure, axis = plt.subplots(figsize=(6, 3.6), dpi=120)
    if train:
        axis.plot(*zip(*train), label="train cross-entropy", linewidth=1)
    if val:
        axis.plot(*zip(*val), "o-", label="validation loss", markersize=3)
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(png_path)
    plt.close(figure)
