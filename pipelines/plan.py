"""Plan a run: the mesh, schedule and microbatching for N devices of M GiB.

    python -m pipelines.plan CONFIG.toml --devices N --device-memory GIB
        [--accelerator NAME] [--slices S] [--top K] [--out BEST.toml] [--explain MESH]
        [--peak-tflops F] [--ici-gbps G] [--dcn-gbps G] [--measure STEPS]
        [--set KEY=VALUE ...]

Searches every mesh factorisation of N devices (``dp`` or ``pp`` across the S slices), every
schedule with its repeats, every split of the config's global batch into accumulation steps
and microbatches, stage remat and layer remat that the run's rules accept
(`eqxzoo.run.planner`); prices each (memory per device, step time split into compute,
exposed communication within and across slices, and bubble; MFU), then compiles the K best
that fit on abstract shapes and prints their compiled memory beside the prediction (one
that does not fit after all is replaced by the next). ``--out`` writes the best as a run
config `pipelines.run` takes unchanged. Plans compile on N simulated CPU devices on any host
(XLA:CPU, the compiler the memory model is fitted to), unless ``--measure 5``: then on this
host's own devices (N must be their number), and the best plan's step runs there, its
median time of 5 steps printed beside the prediction with the MFU it reached.
``--explain dp=8,pp=2`` lists why each plan on that mesh was refused, and the ones that
fit. ``--calibrate`` compiles `eqxzoo.run.planner.CALIBRATION` and prints the memory
model's fit (weights to put in `MEMORY_MODEL`) and its accuracy.
"""

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from eqxzoo.errors import EXIT_OK, run_command
from pipelines.cli import absolute_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.plan", description=__doc__.split("\n")[0]
    )
    parser.add_argument("config", type=Path, nargs="?", help="TOML run config (see configs/)")
    parser.add_argument("--devices", type=int, help="devices in all (N)")
    parser.add_argument("--device-memory", type=float, metavar="GIB", help="memory per device")
    parser.add_argument(
        "--accelerator", default="H100", help="the chip (see --list-accelerators); default H100"
    )
    parser.add_argument("--slices", type=int, default=1, help="slices (hosts, TPU slices)")
    parser.add_argument("--top", type=int, default=5, help="plans to compile and print")
    parser.add_argument("--out", type=absolute_path, help="write the best plan's run config")
    parser.add_argument("--explain", metavar="MESH", help="why plans on MESH were refused")
    parser.add_argument("--peak-tflops", type=float, help="override the chip's bf16 peak")
    parser.add_argument("--ici-gbps", type=float, help="override the in-slice GB/s per device")
    parser.add_argument("--dcn-gbps", type=float, help="override the cross-slice GB/s per device")
    parser.add_argument(
        "--measure", type=int, default=0, metavar="STEPS", help="time the best plan's step here"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--list-accelerators", action="store_true")
    parser.add_argument("--calibrate", action="store_true")
    args = parser.parse_args(argv)
    if args.list_accelerators or args.calibrate:
        return args
    if args.config is None or args.devices is None or args.device_memory is None:
        parser.error("a config, --devices and --device-memory are needed")
    if args.devices < 1 or args.slices < 1 or args.device_memory <= 0:
        parser.error("--devices, --slices and --device-memory must be positive")
    if args.top < 0 or args.measure < 0:
        parser.error("--top and --measure must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: plan(args))


def plan(args: argparse.Namespace) -> int:
    from eqxzoo.run import planner

    if args.list_accelerators:
        for accelerator in planner.ACCELERATORS.values():
            print(planner.describe_accelerator(accelerator))
        return EXIT_OK
    from eqxzoo.runtime import setup_runtime

    if args.calibrate:
        setup_runtime(compilation_cache_dir="", devices=planner.CALIBRATION_DEVICES)
        planner.print_calibration(print)
        return EXIT_OK
    from eqxzoo.run.config import load_config

    config = load_config(args.config, args.overrides)
    accelerator = planner.accelerator_named(
        args.accelerator,
        peak_tflops=args.peak_tflops,
        ici_gbps=args.ici_gbps,
        dcn_gbps=args.dcn_gbps,
    )
    explain = planner.parse_mesh(args.explain) if args.explain else None
    if not args.measure and "JAX_PLATFORMS" not in os.environ:
        # N simulated CPU devices on any host, accelerators or not: the compiler the memory
        # model is fitted to; only --measure runs on this host's own devices.
        import jax

        jax.config.update("jax_platforms", "cpu")
    setup_runtime(compilation_cache_dir="", devices=args.devices)
    started = time.perf_counter()
    result = planner.plan_run(
        config,
        devices=args.devices,
        slices=args.slices,
        accelerator=accelerator,
        memory_gib=args.device_memory,
        top=args.top,
        explain=explain,
        say=print,
        measure=args.measure,
    )
    if args.out is not None and result:
        from eqxzoo.run.config import config_to_toml

        best = result[0].plan.run_config()
        best = dataclasses.replace(best, run=dataclasses.replace(best.run, name=config.run.name))
        args.out.write_text(config_to_toml(best))
        print(f"wrote the best plan to {args.out}")
    print(f"planned in {time.perf_counter() - started:.0f} s")
    return EXIT_OK


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
