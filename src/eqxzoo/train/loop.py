"""The training loop: data, state (fresh or resumed), steps, evaluation, checkpoints, reports.

The host never waits on the devices to log: step ``k``'s metrics are fetched after step
``k + 1`` has been dispatched, so the devices always have the next step queued (the idea of
torch_xla's asynchronous step closures). The loop blocks only where it must: evaluation,
checkpoint saves (orbax copies the arrays off the devices, then writes in the background)
and the end of the run.

A run directory holds ``config.toml`` (the resolved config), ``checkpoints/``,
``metrics.jsonl``, ``tensorboard/``, ``loss.png`` and, with ``--profile``, ``profile/``.
"""

import dataclasses
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from eqxzoo.config import RunConfig, config_to_dict, config_to_toml, step_config
from eqxzoo.data import (
    BatchShape,
    check_vocab,
    open_split,
    train_batches,
    validation_batches,
)
from eqxzoo.data.prepare import prepare_stdlib_corpus
from eqxzoo.parallel import make_mesh
from eqxzoo.train.checkpoint import Checkpointer, CheckpointWarning, StopSignal
from eqxzoo.train.report import (
    LOSS_PLOT_FILE,
    MetricsWriter,
    ProgressBar,
    flops_per_token,
    peak_flops,
    plot_losses,
)
from eqxzoo.train.step import (
    abstract_checkpoint_layout,
    abstract_train_state,
    batch_sharding,
    checkpoint_layout,
    from_checkpoint_layout,
    init_train_state,
    make_eval_step,
    make_train_step,
)

CONFIG_FILE = "config.toml"
CHECKPOINT_DIR = "checkpoints"
PROFILE_DIR = "profile"
STDLIB = "stdlib"


class RunStopped(RuntimeError):
    """The run stopped for a reason the user must see (repeated non-finite steps)."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Command-line choices that are not part of the config."""

    run_dir: Path
    stop_after: int | None = None
    profile: tuple[int, int] | None = None
    started_at: float = dataclasses.field(default_factory=time.perf_counter)


@dataclasses.dataclass
class RunSummary:
    first_step: int
    last_step: int
    startup_seconds: float
    final_loss: float | None
    val_loss: float | None
    stopped_by_signal: bool


def data_directory(config: RunConfig) -> Path:
    """The prepared corpus: ``data.path``, or the built-in stdlib corpus prepared on first use."""
    if config.data.path == STDLIB:
        return prepare_stdlib_corpus(vocab_size=config.data.vocab_size)
    return Path(config.data.path).expanduser()


def batch_shape(config: RunConfig, *, grad_accum: int | None = None) -> BatchShape:
    return BatchShape(
        grad_accum=config.data.grad_accum if grad_accum is None else grad_accum,
        microbatches=config.pipeline.microbatches,
        batch_size=config.data.batch_size,
        seq_len=config.data.seq_len,
    )


class _Trainer:
    """The state of one run of the loop; `run` is the whole story."""

    def __init__(self, config: RunConfig, options: RunOptions, say: Callable[[str], None]):
        self.config = config
        self.options = options
        self.is_main = jax.process_index() == 0
        self.say = say if self.is_main else (lambda text: None)
        self.run_dir = options.run_dir
        self.mesh = make_mesh(config.mesh)
        self.on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        self.step_config = step_config(config)
        self.total_steps = config.run.steps
        if options.stop_after is not None:
            self.total_steps = min(self.total_steps, options.stop_after)

    def open_data(self):
        directory = data_directory(self.config)
        train_documents = open_split(directory, "train")
        check_vocab(train_documents, self.config.model.vocab_size)
        sharding = batch_sharding(self.mesh)
        self.batches = train_batches(
            train_documents,
            batch_shape(self.config),
            sharding,
            seed=self.config.data.seed,
            prefetch=self.config.data.prefetch,
            num_threads=self.config.data.num_threads,
        )
        self.val_batches = []
        if self.config.run.eval_every > 0:
            val_documents = open_split(directory, "val", verify=False)
            self.val_batches = validation_batches(
                val_documents,
                batch_shape(self.config, grad_accum=1),
                sharding,
                batches=self.config.run.eval_batches,
            )

    def open_state(self):
        """Resume from the newest usable checkpoint, or initialise."""
        self.target = abstract_train_state(
            self.config.model, config=self.step_config, mesh=self.mesh
        )
        self.checkpointer = Checkpointer(
            self.run_dir / CHECKPOINT_DIR,
            every=self.config.checkpoint.every,
            keep=self.config.checkpoint.keep,
            # Simulated CPU devices already live in host memory: an asynchronous save would
            # first copy the whole state there again.
            async_save=self.config.checkpoint.async_save and not self.on_cpu,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            restored = self.checkpointer.restore_latest(
                abstract_checkpoint_layout(self.target), self.batches
            )
        for warning in caught:
            self.say(f"warning: {warning.message}")
        if restored is None:
            key = jax.random.key(self.config.run.seed)
            self.state = init_train_state(
                self.config.model, key, config=self.step_config, mesh=self.mesh
            )
            self.step = 0
            self.skipped_total = 0
            return
        self.state = from_checkpoint_layout(restored.state, self.target, consume=True)
        self.step = restored.step
        self.skipped_total = int(restored.meta.get("skipped_total", 0))
        self.say(f"resumed from the checkpoint at step {self.step}")

    def save(self, *, force: bool) -> bool:
        if not (force or self.step % self.config.checkpoint.every == 0):
            return False
        meta = {
            "step": self.step,
            "skipped_total": self.skipped_total,
            "config": config_to_dict(self.config),
        }
        # The state is converted to the checkpoint layout array by array, in place, and back
        # after the save: a second copy of a state that fills the host would not fit.
        plain = checkpoint_layout(self.state, consume=True)
        try:
            return self.checkpointer.maybe_save(self.step, plain, self.batches, meta, force=force)
        finally:
            self.state = from_checkpoint_layout(plain, self.target, consume=True)

    def evaluate(self) -> float:
        losses = [self.eval_step(self.state.model, batch) for batch in self.val_batches]
        return float(np.mean(jax.device_get(losses)))

    def run(self) -> RunSummary:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            (self.run_dir / CONFIG_FILE).write_text(config_to_toml(self.config), encoding="utf-8")
        self.open_data()
        self.open_state()
        first_step = self.step
        self.train_step = make_train_step(self.step_config, self.mesh)
        self.eval_step = make_eval_step(self.step_config, self.mesh)
        tokens_per_step = batch_shape(self.config).windows * self.config.data.seq_len
        model_flops = flops_per_token(self.config.model, self.config.data.seq_len)
        peak, peak_source = peak_flops(self.mesh.devices.flatten().tolist())
        writer = None
        if self.is_main:
            writer = MetricsWriter(
                self.run_dir,
                tensorboard=self.config.run.tensorboard,
                wandb_project=self.config.run.wandb_project if self.config.run.wandb else None,
                config=config_to_dict(self.config),
                resume_from_step=self.step,
            )
        progress = ProgressBar(
            self.total_steps, every=self.config.run.log_every, enabled=self.is_main
        )
        self.say(
            f"training steps {self.step + 1}..{self.total_steps} on {self.mesh.devices.size} "
            f"devices (mesh {dict(self.mesh.shape)}), {tokens_per_step:,} tokens per step; "
            f"MFU against the {peak_source} ({peak / 1e12:.3g} TFLOP/s)"
        )
        startup = None
        pending: tuple[int, dict[str, Any]] | None = None
        last_time = time.perf_counter()
        nonfinite_in_a_row = 0
        final_loss = val_loss = None
        stopped_by_signal = False

        def report(step: int, metrics: dict[str, Any]) -> None:
            nonlocal last_time, startup, nonfinite_in_a_row, final_loss
            values = jax.device_get(metrics)
            now = time.perf_counter()
            seconds = now - last_time
            last_time = now
            if startup is None:
                startup = now - self.options.started_at
                self.say(f"first step done {startup:.1f} s after start (compilation included)")
            skipped = int(values["skipped"])
            self.skipped_total += skipped
            nonfinite_in_a_row = nonfinite_in_a_row + 1 if skipped else 0
            final_loss = float(values["loss"])
            record = step_record(step, values, seconds, tokens_per_step, model_flops, peak)
            record["skipped_total"] = self.skipped_total
            if writer is not None:
                writer.write(record)
            progress.update(
                step,
                loss=record["loss"],
                tokens_per_s=record["tokens_per_s"],
                seconds_per_step=seconds,
            )
            if nonfinite_in_a_row >= self.config.run.max_nonfinite:
                raise RunStopped(
                    f"stopped: {nonfinite_in_a_row} steps in a row (up to step {step}) had a "
                    f"non-finite loss or gradient and were skipped (run.max_nonfinite = "
                    f"{self.config.run.max_nonfinite}); the last checkpoint holds finite values"
                )

        try:
            with StopSignal() as stop:
                while self.step < self.total_steps:
                    self.maybe_profile(self.step + 1)
                    batch = next(self.batches)
                    self.state, metrics = self.train_step(self.state, batch)
                    self.step += 1
                    if pending is not None:
                        report(*pending)
                    pending = (self.step, metrics)
                    self.maybe_profile_stop(self.step)
                    evaluate_now = self.val_batches and (
                        self.step % self.config.run.eval_every == 0 or self.step == self.total_steps
                    )
                    if evaluate_now:
                        report(*pending)
                        pending = None
                        val_loss = self.evaluate()
                        if writer is not None:
                            writer.write({"step": self.step, "val_loss": val_loss})
                        progress.message(f"step {self.step}: validation loss {val_loss:.4f}")
                    if stop.should_stop(self.step):
                        stopped_by_signal = True
                        break
                    self.save(force=False)
                if pending is not None:
                    report(*pending)
                    pending = None
                self.save(force=True)
                if stopped_by_signal:
                    progress.message(f"stopped by a signal: checkpoint saved at step {self.step}")
        except BaseException:
            if jax.process_count() > 1:
                # The other processes may be waiting for this one inside a collective: a
                # cooperative clean-up (orbax's barriers) would wait for them forever. Leave at
                # once; their coordination service notices this process is gone.
                self.batches.close()
                raise
            self.checkpointer.close()
            raise
        else:
            self.checkpointer.close()
        finally:
            self.batches.close()
            if writer is not None:
                writer.close()
        if self.is_main and self.config.run.plot:
            plot_losses(
                self.run_dir / "metrics.jsonl",
                self.run_dir / LOSS_PLOT_FILE,
                self.config.run.name,
            )
        return RunSummary(
            first_step=first_step,
            last_step=self.step,
            startup_seconds=startup or 0.0,
            final_loss=final_loss,
            val_loss=val_loss,
            stopped_by_signal=stopped_by_signal,
        )

    def maybe_profile(self, step: int) -> None:
        if self.options.profile is not None and step == self.options.profile[0]:
            jax.profiler.start_trace(str(self.run_dir / PROFILE_DIR))

    def maybe_profile_stop(self, step: int) -> None:
        if self.options.profile is not None and step == self.options.profile[1]:
            jax.block_until_ready(self.state)
            jax.profiler.stop_trace()
            self.say(f"profile of steps {self.options.profile[0]}..{step} in {PROFILE_DIR}/")


def step_record(
    step: int,
    values: dict[str, Any],
    seconds: float,
    tokens_per_step: int,
    flops_per_token_: float,
    peak: float,
) -> dict[str, Any]:
    """One ``metrics.jsonl`` line for a training step."""
    tokens_per_s = tokens_per_step / seconds if seconds > 0 else 0.0
    record = {
        "step": step,
        "loss": float(values["loss"]),
        "cross_entropy": float(values["cross_entropy"]),
        "grad_norm": float(values["grad_norm"]),
        "lr": float(values["learning_rate"]),
        "tokens_per_s": tokens_per_s,
        "step_seconds": seconds,
        "mfu": tokens_per_s * flops_per_token_ / peak,
        "skipped": int(values["skipped"]),
    }
    for name in ("load_balance_loss", "router_z_loss", "dropped_fraction"):
        if name in values:
            record[name] = float(values[name])
    if "expert_fraction" in values:
        # (layers, experts) fraction of routed tokens; 1.0 = perfectly balanced.
        load = np.asarray(values["expert_fraction"]) * values["expert_fraction"].shape[-1]
        record["expert_load_max"] = float(load.max())
        record["expert_load"] = np.round(load.mean(axis=0), 4).tolist()
    return record


def train(config: RunConfig, options: RunOptions, say: Callable[[str], None] = print) -> RunSummary:
    """Run (or resume) training as configured; see the module doc for what is written where.

    Raises `RunStopped` after ``run.max_nonfinite`` non-finite steps in a row, and the
    `DataError` / `MeshError` / `CheckpointError` of a bad corpus, mesh or checkpoint.
    """
    return _Trainer(config, options, say).run()
