"""The training loop: data, state (fresh or resumed), steps, evaluation, checkpoints, reports.

The host never waits on the devices to log: step ``k``'s metrics are fetched after step
``k + 1`` has been dispatched, so the devices always have the next step queued (the idea of
torch_xla's asynchronous step closures). The loop blocks only where it must: evaluation,
checkpoint saves (orbax copies the arrays off the devices, then writes in the background)
and the end of the run.

A run directory holds ``run.lock`` (see `eqxzoo.run.rundir`), ``config.toml`` (the
resolved config), ``checkpoints/``, ``tokenizer.json`` and, for a run from a Hugging Face
checkpoint, ``hf_source/`` (`eqxzoo.run.provenance`), ``metrics.jsonl``, ``tensorboard/``,
``loss.png`` and, with ``--profile``, ``profile/``. Before anything is initialised, the run locks its directory,
checks that a resume is the same run and has steps left to train, and compiles the step to
check that it fits in memory. Whatever a phase opens is closed on every way out.
"""

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from eqxzoo.data import (
    BatchShape,
    check_vocab,
    open_split,
    train_batches,
    validation_batches,
)
from eqxzoo.errors import EXIT_STOPPED, UserError
from eqxzoo.nn.lora import with_new_adapters
from eqxzoo.parallel import make_mesh
from eqxzoo.run.config import (
    RunConfig,
    check_kernel_platform,
    config_to_dict,
    lora_line,
    run_model_config,
    step_config,
)
from eqxzoo.run.provenance import (
    batches_carry_documents,
    check_hf_tokenizer,
    check_run_tokenizer,
    data_directory,
    keep_run_sources,
)
from eqxzoo.run.rundir import (
    CHECKPOINT_DIR,
    has_checkpoints,
    prepare_run_dir,
    write_run_config,
)
from eqxzoo.runtime import counts_of_every_process, on_every_process
from eqxzoo.train.checkpoint import Checkpointer, finished_steps, saves_asynchronously
from eqxzoo.train.layout import (
    abstract_checkpoint_layout,
    checkpoint_layout,
    from_checkpoint_layout,
)
from eqxzoo.train.memory import (
    MemoryCheck,
    PlanDoesNotFit,
    StepMemory,
    check_fits,
    host_buffer_bytes,
    memory_checks,
)
from eqxzoo.train.report import (
    LOSS_PLOT_FILE,
    MetricsWriter,
    ProgressBar,
    peak_flops,
    plot_losses,
)
from eqxzoo.train.state import (
    TrainState,
    abstract_train_state,
    init_train_state,
    init_train_state_from,
    train_state_axes,
)
from eqxzoo.train.step import (
    batch_sharding,
    bubble_verdicts,
    compile_eval_step,
    compile_train_step_for,
)
from eqxzoo.train.stop_signal import StopSignal, raise_a_stop_received
from models import flops_per_token, model_factory
from models.hf import open_hf

PROFILE_DIR = "profile"


class RunStopped(UserError, RuntimeError):
    """The run stopped for a reason the user must see (repeated non-finite steps)."""

    exit_code = EXIT_STOPPED


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

    @property
    def trained(self) -> bool:
        """Whether any step ran (not when the run was already at its last step)."""
        return self.last_step > self.first_step


def run_memory_checks(
    step: StepMemory, config: RunConfig, devices: list[jax.Device]
) -> list[MemoryCheck]:
    """`memory_checks` for ``config``'s run on this process's ``devices``."""
    host_buffers = host_buffer_bytes(
        step,
        len(devices),
        batch_tokens=config.tokens_per_step // jax.process_count(),
        prefetch=config.data.prefetch,
        async_save=saves_asynchronously(config.checkpoint.async_save, devices[0].platform),
    )
    return memory_checks(step, devices, host_buffers=host_buffers)


def batch_shape(config: RunConfig, *, grad_accum: int | None = None) -> BatchShape:
    return BatchShape(
        grad_accum=config.data.grad_accum if grad_accum is None else grad_accum,
        microbatches=config.pipeline.microbatches,
        batch_size=config.data.batch_size,
        seq_len=config.data.seq_len,
    )


@dataclasses.dataclass
class _StepReports:
    """What the step reports carry from one step to the next.

    ``pending`` is the last step dispatched, whose metrics are fetched only after the next
    step is dispatched (or before an evaluation, a stop, the end); ``last_time`` is when the
    previous step was reported, so a step's time is the gap between two reports.
    """

    last_time: float
    pending: tuple[int, dict[str, Any]] | None = None
    startup_seconds: float | None = None
    nonfinite_in_a_row: int = 0
    final_loss: float | None = None


class _Trainer:
    """The state of one run of the loop; `run` is the whole story, told as phases.

    Besides what the phases open (``batches``, ``checkpointer``, ``state``, the steps,
    ``writer``, ``progress``), a run carries:

    - ``step`` and ``skipped_total``: where training is, saved with every checkpoint;
    - ``reports``: the `_StepReports` bookkeeping from one step's report to the next;
    - ``val_loss``: the latest validation loss, None before the first evaluation;
    - ``stopped_by_signal``: whether a stop signal (or the preemption service) ended the
      run before ``total_steps``;
    - ``nothing_to_do``: whether the run was already at ``total_steps`` and ended at once.
    """

    def __init__(self, config: RunConfig, options: RunOptions, say: Callable[[str], None]):
        self.config = config
        self.options = options
        self.is_main = jax.process_index() == 0
        self.say = say if self.is_main else (lambda text: None)
        self.run_dir = options.run_dir
        self.mesh = make_mesh(config.mesh)
        check_kernel_platform(config, self.mesh.devices.flat[0].platform)
        self.async_save = saves_asynchronously(
            config.checkpoint.async_save, self.mesh.devices.flat[0].platform
        )
        self.step_config = step_config(config)
        self.make_model = model_factory(run_model_config(config))
        self.total_steps = config.run.steps
        if options.stop_after is not None:
            self.total_steps = min(self.total_steps, options.stop_after)
        if options.profile is not None and options.profile[1] > self.total_steps:
            start, stop = options.profile
            raise UserError(
                f"--profile {start}:{stop}: the run ends at step {self.total_steps}, so the "
                "trace would never be written"
            )
        self.val_loss: float | None = None
        self.stopped_by_signal = False
        self.nothing_to_do = False

    def run(self) -> RunSummary:
        with contextlib.ExitStack() as opened:
            self.open_run_dir(opened)
            at_the_end = self.nothing_left_to_do()
            if at_the_end is not None:
                return at_the_end
            self.open_hf_checkpoint()
            self.open_data(opened)
            self.compile_steps()
            self.open_state(opened)
            at_the_end = self.nothing_left_to_do(self.step)
            if at_the_end is not None:
                return at_the_end
            raise_a_stop_received()
            if self.is_main:  # every check passed and the state is open
                write_run_config(self.run_dir, self.config)
                keep_run_sources(self.run_dir, self.config, self.data_dir, fresh=self.step == 0)
            first_step = self.step
            self.open_reports(opened)
            with StopSignal() as stop:
                self.train_until_done(stop)
                self.finish()
        return self.summary(first_step)

    def open_run_dir(self, opened: contextlib.ExitStack) -> None:
        """Process 0 locks the run directory and checks that this config may resume what it
        holds (`eqxzoo.run.rundir`); the other processes follow its verdict."""
        refusal = None
        if self.is_main:
            try:
                run_lock = prepare_run_dir(self.run_dir, self.config, lock=True, warn=self.say)
                opened.callback(run_lock.release)
                opened.push(self.plot_at_the_end)
            except (UserError, OSError) as error:
                refusal = error
        if not on_every_process(refusal is None):
            raise refusal or UserError(
                f"process 0 refused --run-dir {self.run_dir} (its error line says why)"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def nothing_left_to_do(self, reached: int | None = None) -> RunSummary | None:
        """When the run is already at ``total_steps``: say so in one line (naming what sets
        it, ``--steps N`` or ``run.steps = N``) and return the summary of a run that trained
        nothing; None when there are steps to train.

        Before anything is compiled or read (``reached`` None), this is known only when even
        the oldest finished checkpoint is at ``total_steps``: a damaged newest one falls back
        to an older one, which may leave steps to train. Otherwise it is asked again once the
        state is restored, at the restored step."""
        if reached is None:
            directory = self.run_dir / CHECKPOINT_DIR
            steps = finished_steps(directory) if directory.is_dir() else []
            oldest, newest = (steps[0], steps[-1]) if steps else (0, 0)
            found = counts_of_every_process(np.array([oldest, newest]))[0]
            if int(found[0]) < self.total_steps:
                return None
            reached = int(found[1])
        elif reached < self.total_steps:
            return None
        stop_after = self.options.stop_after
        if stop_after is not None and stop_after <= self.config.run.steps:
            setting = f"--steps {stop_after}"
        else:
            setting = f"run.steps = {self.config.run.steps}"
        self.say(f"the run is at step {reached}; {setting} leaves nothing to do")
        self.nothing_to_do = True
        return RunSummary(
            first_step=reached,
            last_step=reached,
            startup_seconds=0.0,
            final_loss=None,
            val_loss=None,
            stopped_by_signal=False,
        )

    def open_hf_checkpoint(self) -> None:
        """A fresh run from ``init_from_hf`` opens its checkpoint now: every tensor's name,
        shape and dtype is checked before anything compiles (the weights are read later, by
        slices); a resume never reads it."""
        self.hf_checkpoint = None
        if self.config.init_from_hf and not has_checkpoints(self.run_dir):
            self.hf_checkpoint = open_hf(self.config.init_from_hf)
            warning = check_hf_tokenizer(self.config, data_directory(self.config))
            if warning is not None:
                self.say(f"warning: {warning}")

    def compile_steps(self) -> None:
        """Compile the train step from the state's shapes alone and refuse a plan whose
        memory does not fit (`eqxzoo.train.memory`), before anything is initialised; the
        evaluation step compiles on its first call."""
        self.target = abstract_train_state(self.make_model, config=self.step_config, mesh=self.mesh)
        self.axes = train_state_axes(self.make_model, config=self.step_config)
        self.train_step, self.step_config = compile_train_step_for(
            self.step_config,
            self.mesh,
            self.target,
            batch_shape(self.config).shape,
            documents=self.documents,
            verdicts=bubble_verdicts(),
        )
        if not self.step_config.skip_bubbles:
            self.say(
                "note: the stages compute through their bubbles (XLA:CPU cannot skip them in "
                "this program: collective-permutes in the stage)"
            )
        if self.val_batches:
            self.eval_step = compile_eval_step(
                self.step_config,
                self.mesh,
                self.target.model,
                batch_shape(self.config, grad_accum=1).shape,
                documents=self.documents,
            )
        step_memory = StepMemory.of(self.train_step)
        if step_memory is None:
            return
        checks = run_memory_checks(step_memory, self.config, self.mesh.local_devices)
        if not on_every_process(all(check.fits for check in checks)):
            check_fits(checks, step_memory, remat_stages=self.config.pipeline.remat_stages)
            raise PlanDoesNotFit("this plan does not fit on another host (its error line says why)")

    def open_data(self, opened: contextlib.ExitStack) -> None:
        """Open the training batches and, when ``run.eval_every`` > 0, the validation batches."""
        directory = self.data_dir = data_directory(self.config)
        if has_checkpoints(self.run_dir):
            check_run_tokenizer(self.run_dir, directory)
        train_documents = open_split(directory, "train")
        check_vocab(train_documents, self.config.model.vocab_size)
        self.documents = batches_carry_documents(self.config)
        sharding = batch_sharding(self.mesh, self.step_config.rules)
        self.batches = train_batches(
            train_documents,
            batch_shape(self.config),
            sharding,
            seed=self.config.data.seed,
            prefetch=self.config.data.prefetch,
            num_threads=self.config.data.num_threads,
            document_mask=self.documents,
        )
        opened.callback(self.batches.close)
        self.val_batches = []
        if self.config.run.eval_every > 0:
            val_documents = open_split(directory, "val", verify=False)
            self.val_batches = validation_batches(
                val_documents,
                batch_shape(self.config, grad_accum=1),
                sharding,
                batches=self.config.run.eval_batches,
                document_mask=self.documents,
            )

    def open_state(self, opened: contextlib.ExitStack) -> None:
        """Resume from the newest usable checkpoint, or initialise."""
        self.checkpointer = Checkpointer(
            self.run_dir / CHECKPOINT_DIR,
            every=self.config.checkpoint.every,
            keep=self.config.checkpoint.keep,
            async_save=self.async_save,
            warn=lambda text: self.say(f"warning: {text}"),
        )
        opened.push(self.close_checkpointer)
        restored = self.checkpointer.restore_latest(
            abstract_checkpoint_layout(self.target, self.axes, self.step_config.rules),
            self.batches,
        )
        if restored is None:
            self.state = self.fresh_state()
            self.step = 0
            self.skipped_total = 0
            return
        self.state = from_checkpoint_layout(
            restored.state, self.target, self.step_config.schedule, consume=True
        )
        self.step = restored.step
        self.skipped_total = int(restored.meta.get("skipped_total", 0))
        self.say(f"resumed from the checkpoint at step {self.step}")
        if self.options.profile is not None and self.options.profile[0] <= self.step:
            start, stop = self.options.profile
            raise UserError(
                f"--profile {start}:{stop}: the run resumes after step {self.step}; profile "
                "steps still to come"
            )

    def fresh_state(self) -> TrainState:
        """Step 0: parameters from ``init_from_hf`` (each process reading only its devices'
        slices, every slice checked for NaN and Inf as it is read: a non-finite weight is
        refused now, naming its tensor, not at the first save after skipped steps) or from
        the run's seed."""
        if not self.config.init_from_hf:
            key = jax.random.key(self.config.run.seed)
            return init_train_state(self.make_model, key, config=self.step_config, mesh=self.mesh)
        checkpoint = self.hf_checkpoint or open_hf(self.config.init_from_hf)
        checkpoint.files.refuse_non_finite = True
        source = checkpoint.model
        if self.config.lora is not None:  # the checkpoint's weights with new adapters
            adapted = eqx.filter_eval_shape(self.make_model, key=jax.random.key(0))
            source = with_new_adapters(source, adapted, self.config.run.seed)
        state = init_train_state_from(
            self.make_model, source, config=self.step_config, mesh=self.mesh
        )
        read = counts_of_every_process(np.array([checkpoint.files.bytes_read]))[:, 0]
        per_process = ", ".join(f"{n / 1e6:,.2f}" for n in read)
        self.say(
            f"initialised from the Hugging Face checkpoint {checkpoint.directory} "
            f"({checkpoint.files.total_bytes / 1e6:,.2f} MB): MB read per process {per_process}"
        )
        return state

    def close_checkpointer(self, error_type, error, traceback) -> None:
        """Close the checkpointer on the way out, unless a multi-process run is failing: the
        others may be waiting for this process inside a collective, and orbax's cooperative
        clean-up (its barriers) would wait for them forever. Leave at once; their
        coordination service notices this process is gone."""
        if error_type is None or jax.process_count() == 1:
            self.checkpointer.close()

    def open_reports(self, opened: contextlib.ExitStack) -> None:
        """Open the metrics writer (process 0) and the progress bar, say what will run, and
        start the step clock."""
        self.model_flops_per_token = flops_per_token(self.config.model, self.config.data.seq_len)
        self.peak_flops_per_s, peak_source = peak_flops(self.mesh.devices.flatten().tolist())
        self.writer = None
        if self.is_main:
            self.writer = MetricsWriter(
                self.run_dir,
                tensorboard=self.config.run.tensorboard,
                wandb_project=self.config.run.wandb_project if self.config.run.wandb else None,
                config=config_to_dict(self.config),
                resume_from_step=self.step,
            )
            opened.callback(self.writer.close)
        self.progress = ProgressBar(
            self.total_steps, every=self.config.run.log_every, enabled=self.is_main
        )
        dcn = self.config.mesh.dcn
        slices = f"; {dcn.describe()}" if dcn.slices > 1 else ""
        self.say(
            f"training steps {self.step + 1}..{self.total_steps} on {self.mesh.devices.size} "
            f"devices (mesh {dict(self.mesh.shape)}{slices}), {self.config.tokens_per_step:,} tokens "
            f"per step; MFU against the {peak_source} ({self.peak_flops_per_s / 1e12:.3g} TFLOP/s)"
        )
        if lora_line(self.config) is not None:
            self.say(lora_line(self.config))
        self.reports = _StepReports(last_time=time.perf_counter())

    def train_until_done(self, stop: StopSignal) -> None:
        """Step until ``total_steps``, or until ``stop`` says so after a step.

        A step's metrics are reported once the next step is dispatched; between steps come
        the evaluations and the checkpoints that are due.
        """
        while self.step < self.total_steps:
            self.maybe_profile(self.step + 1)
            batch = next(self.batches)
            self.state, metrics = self.train_step(self.state, batch)
            self.step += 1
            self.report_pending_step()
            self.reports.pending = (self.step, metrics)
            self.maybe_profile_stop(self.step)
            self.maybe_evaluate()
            if stop.should_stop(self.step):
                self.stopped_by_signal = True
                return
            self.save(force=False)

    def finish(self) -> None:
        """Report the last step and save it, whether it was due or not."""
        self.report_pending_step()
        self.save(force=True)
        if self.stopped_by_signal:
            self.progress.message(f"stopped by a signal: checkpoint saved at step {self.step}")

    def report_pending_step(self) -> None:
        """Fetch and report the metrics of the step still pending, if there is one."""
        if self.reports.pending is not None:
            self.report_step(*self.reports.pending)
            self.reports.pending = None

    def report_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Write step ``step``'s ``metrics.jsonl`` line and update the progress bar.

        Raises `RunStopped` after ``run.max_nonfinite`` skipped (non-finite) steps in a row.
        """
        reports = self.reports
        values = jax.device_get(metrics)
        now = time.perf_counter()
        seconds = now - reports.last_time
        reports.last_time = now
        if reports.startup_seconds is None:
            reports.startup_seconds = now - self.options.started_at
            self.say(
                f"first step done {reports.startup_seconds:.1f} s after start "
                "(compilation included)"
            )
        skipped = int(values["skipped"])
        self.skipped_total += skipped
        reports.nonfinite_in_a_row = reports.nonfinite_in_a_row + 1 if skipped else 0
        reports.final_loss = float(values["loss"])
        record = step_record(
            step,
            values,
            seconds,
            self.config.tokens_per_step,
            self.model_flops_per_token,
            self.peak_flops_per_s,
        )
        record["skipped_total"] = self.skipped_total
        if self.writer is not None:
            self.writer.write(record)
        self.progress.update(
            step,
            loss=record["loss"],
            tokens_per_s=record["tokens_per_s"],
            seconds_per_step=seconds,
        )
        if reports.nonfinite_in_a_row >= self.config.run.max_nonfinite:
            raise RunStopped(
                f"stopped: {reports.nonfinite_in_a_row} steps in a row (up to step {step}) had "
                f"a non-finite loss or gradient and were skipped (run.max_nonfinite = "
                f"{self.config.run.max_nonfinite}); the last checkpoint holds finite values"
            )

    def maybe_evaluate(self) -> None:
        """Every ``run.eval_every`` steps and after the last one: report the pending step,
        then write and show the validation loss."""
        due = self.val_batches and (
            self.step % self.config.run.eval_every == 0 or self.step == self.total_steps
        )
        if not due:
            return
        self.report_pending_step()
        self.val_loss = self.validation_loss()
        if self.writer is not None:
            self.writer.write({"step": self.step, "val_loss": self.val_loss})
        self.progress.message(f"step {self.step}: validation loss {self.val_loss:.4f}")

    def validation_loss(self) -> float:
        """Mean loss of the current model over the validation batches."""
        losses = [self.eval_step(self.state.model, batch) for batch in self.val_batches]
        return float(np.mean(jax.device_get(losses)))

    def save(self, *, force: bool) -> bool:
        """Save the state as step ``step`` if the checkpointer says it is due (or ``force``).

        Returns whether a save was started.
        """
        if not self.checkpointer.is_due(self.step, force=force):
            return False
        # The step's metrics line goes first: a kill once the checkpoint is committed (whose
        # resume starts after it) must not lose it.
        self.report_pending_step()
        meta = {
            "step": self.step,
            "skipped_total": self.skipped_total,
            "config": config_to_dict(self.config),
        }
        # The state is converted to the checkpoint layout array by array, in place, and back
        # after the save: a second copy of a state that fills the host would not fit.
        schedule = self.step_config.schedule
        plain = checkpoint_layout(
            self.state, self.axes, self.step_config.rules, schedule, consume=True
        )
        try:
            return self.checkpointer.save(self.step, plain, self.batches, meta)
        finally:
            self.state = from_checkpoint_layout(plain, self.target, schedule, consume=True)

    def plot_at_the_end(self, error_type, error, traceback) -> None:
        """On process 0, once the run trained, ended well and its metrics are closed, but with
        the run directory still locked: plot ``metrics.jsonl`` into ``loss.png`` if
        ``run.plot``."""
        if error_type is None and self.config.run.plot and not self.nothing_to_do:
            plot_losses(
                self.run_dir / "metrics.jsonl",
                self.run_dir / LOSS_PLOT_FILE,
                self.config.run.name,
            )

    def summary(self, first_step: int) -> RunSummary:
        return RunSummary(
            first_step=first_step,
            last_step=self.step,
            startup_seconds=self.reports.startup_seconds or 0.0,
            final_loss=self.reports.final_loss,
            val_loss=self.val_loss,
            stopped_by_signal=self.stopped_by_signal,
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
        # The tokens the loss is a mean over (a loss mask leaves the others out).
        "target_tokens": int(values["target_tokens"]),
        "masked_fraction": float(values["masked_fraction"]),
        "tokens_per_s": tokens_per_s,
        "step_seconds": seconds,
        "mfu": tokens_per_s * flops_per_token_ / peak,
        "skipped": int(values["skipped"]),
    }
    for name in ("load_balance_loss", "router_z_loss", "dropped_fraction", "padding_fraction"):
        if name in values:
            record[name] = float(values[name])
    if "expert_fraction" in values:
        # (layers, experts) fraction of routed tokens; 1.0 = perfectly balanced.
        load = np.asarray(values["expert_fraction"]) * values["expert_fraction"].shape[-1]
        record["expert_load_max"] = float(load.max())
        record["expert_load"] = np.round(load.mean(axis=0), 4).tolist()
    if "device_load" in values:
        # (layers, ep devices) tokens received over their mean: expert parallelism's balance.
        record["device_load_max"] = float(np.max(values["device_load"]))
    return record


def train(config: RunConfig, options: RunOptions, say: Callable[[str], None] = print) -> RunSummary:
    """Run (or resume) training as configured; see the module doc for what is written where.

    Raises `RunStopped` after ``run.max_nonfinite`` non-finite steps in a row, and the
    `DataError` / `MeshError` / `CheckpointError` of a bad corpus, mesh or checkpoint.
    """
    return _Trainer(config, options, say).run()
