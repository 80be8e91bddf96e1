"""Train a model from a TOML config.

    python -m pipelines.run CONFIG.toml [--set section.key=value ...] [--steps N]
        [--run-dir DIR] [--dry-run] [--profile START:STOP]

``--steps N`` stops after step N (the schedule still spans ``run.steps``); ``--run-dir``
defaults to ``runs/<run.name>``; a rerun with the same run directory resumes from its latest
checkpoint, if its config changes only what README's "Run directories" lists. The run locks
its directory: a second run on it is refused. Before anything is initialised, the compiled
step's memory is checked against the machine's. ``--dry-run`` validates the config, builds
the mesh and compiles the step, prints parameter counts, shardings, per-device memory and
whether it fits, and exits without training (and without the lock).
``--profile START:STOP`` traces steps START..STOP into ``RUN_DIR/profile``.

With no accelerator the mesh's devices are simulated on the CPU. Under a cluster launcher
(SLURM, Open MPI, or JAX_COORDINATOR_ADDRESS set) or `pipelines.launch`, the processes
join one global mesh through `jax.distributed.initialize`. A config, data, mesh,
memory or checkpoint problem (a busy run directory, a full disk) is one ``error:`` line and
exit code 2; repeated non-finite steps stop
the run with exit code 3; a process of a multi-process run that loses a peer exits with code
4, naming the lost process. SIGTERM or Ctrl-C stops the run with exit code 0: after a step,
saving it; before the first step (while loading, compiling, initialising), at once with one
line, nothing to save. A run already at the step it is asked to reach (``--steps``,
``run.steps``) says so in one line and exits 0.
"""

import argparse
import os
import sys
import time
from pathlib import Path

from eqxzoo.allocator import rerun_with_huge_pages
from eqxzoo.errors import EXIT_LOST_PEER, EXIT_OK, UserError, fail, run_command
from eqxzoo.train.stop_signal import (
    StoppedBeforeFirstStep,
    stopped_by_signal,
    stopping_before_first_step,
)
from pipelines.cli import absolute_path

STARTED_AT = time.perf_counter()


def parse_profile(text: str) -> tuple[int, int]:
    try:
        start, stop = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected START:STOP step numbers, got {text!r}"
        ) from None
    if not 1 <= start <= stop:
        raise argparse.ArgumentTypeError(f"expected 1 <= START <= STOP, got {text!r}")
    return start, stop


def non_empty_path(text: str) -> Path:
    """A path argument, absolute (`pipelines.cli.absolute_path`); an empty one (an unset shell
    variable) is refused, not the current directory."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return absolute_path(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "config",
        type=Path,
        nargs="?",
        help="TOML run config (see configs/); not with --repair-config",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set mesh.dp=4 (repeatable)",
    )
    parser.add_argument("--steps", type=int, help="stop after this step")
    parser.add_argument(
        "--run-dir", type=non_empty_path, help="outputs and checkpoints (default runs/NAME)"
    )
    parser.add_argument("--dry-run", action="store_true", help="plan the run, do not train")
    parser.add_argument("--profile", type=parse_profile, metavar="START:STOP")
    parser.add_argument(
        "--repair-config",
        action="store_true",
        help="rewrite --run-dir's config.toml from its newest checkpoint's config, then exit",
    )
    args = parser.parse_args(argv)
    if args.repair_config:
        if args.run_dir is None or args.config is not None:
            parser.error("--repair-config takes --run-dir RUN_DIR and no config")
    elif args.config is None:
        parser.error("a config is needed (or --repair-config with --run-dir)")
    if args.steps is not None and args.steps < 0:
        parser.error(f"--steps must be >= 0, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    with stopping_before_first_step():
        try:
            args = parse_args(argv)
            return run_command(lambda: run(args))
        except BaseException as error:
            if not stopped_by_signal(error):
                raise
            print(StoppedBeforeFirstStep.MESSAGE, flush=True)
            return EXIT_OK


def run(args: argparse.Namespace) -> int:
    if args.repair_config:
        from eqxzoo.run.rundir import CONFIG_FILE, repair_run_config

        step = repair_run_config(args.run_dir)
        print(
            f"wrote {args.run_dir / CONFIG_FILE} from the config of the checkpoint of step {step}"
        )
        return EXIT_OK
    # Config errors are reported before any JAX work (no backend is started yet).
    from eqxzoo.run.config import devices_needed, load_config

    config = load_config(args.config, args.overrides)

    from eqxzoo.runtime import setup_runtime

    setup_runtime(
        compilation_cache_dir=config.run.compilation_cache_dir, devices=devices_needed(config)
    )

    from eqxzoo.run.loop import RunOptions, train

    run_dir = args.run_dir or absolute_path(Path("runs") / config.run.name)
    try:
        if args.dry_run:
            from eqxzoo.run.plan import dry_run

            dry_run(config)
            return EXIT_OK
        summary = train(
            config,
            RunOptions(
                run_dir=run_dir,
                stop_after=args.steps,
                profile=args.profile,
                started_at=STARTED_AT,
            ),
        )
    except BaseException as error:
        import jax

        if jax.process_count() == 1:
            raise
        from eqxzoo.runtime import lost_processes_message

        # Exit now: the interpreter's exit hooks (jax.distributed.shutdown's barrier) would
        # wait minutes for peers that are gone, stuck, or waiting for this one.
        if isinstance(error, StoppedBeforeFirstStep):
            print(StoppedBeforeFirstStep.MESSAGE, flush=True)
            code = EXIT_OK
        elif isinstance(error, UserError):
            code = fail(str(error), error.exit_code)
        else:
            code = fail(lost_processes_message(error), EXIT_LOST_PEER)
        sys.stdout.flush()
        os._exit(code)
    import jax

    if jax.process_index() == 0 and summary.trained:
        losses = f"final loss {summary.final_loss:.4f}" if summary.final_loss is not None else ""
        if summary.val_loss is not None:
            losses += f", validation loss {summary.val_loss:.4f}"
        print(
            f"done: steps {summary.first_step + 1}..{summary.last_step}, {losses}; "
            f"outputs in {run_dir}/"
        )
    return EXIT_OK


if __name__ == "__main__":
    rerun_with_huge_pages("pipelines.run")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
