"""The project benchmark: everything measured side by side in one run, reported as ratios.

    python -m pipelines.bench [--json FILE] [--repeats N] [--only PART ...] [--quick]

1. training tokens/s of the reference model on one device, as model FLOP/s over the FLOP/s
   of a plain jitted 2048x2048 fp32 matmul timed in the same process;
2. pipeline efficiency on 8 simulated devices: tokens/s of dp=2 x pp=4 (M=8) over dp=8 on
   the same global batch, for GPipe and circular;
3. compile time of the train step for 4, 16 and 64 layers;
4. per-device memory of the compiled step for pp in {1, 2, 4};
5. with torch installed, the same model in PyTorch eager: our FLOP/s over PyTorch's;
6. the data loader over the prepared stdlib corpus: tokens/s of `eqxzoo.data.train_batches`
   (global batches on configs/tiny.toml's mesh) next to a plain numpy memmap reader of the
   same token stream, and next to the tokens/s that tiny.toml's train step consumes;
7. the pipeline schedules at P = 4 (dp=2 x pp=4, 8 layers, B sequences per microbatch,
   stage remat on): per-device temporary bytes of the compiled step for M in 8, 16, 32
   (``schedule_activation_bytes``); at M = 8 tokens/s (``schedule_tokens_per_s``) and its
   ratio to 1F1B's (``schedule_tokens_per_s_vs_1f1b``, spread in
   ``schedule_tokens_per_s_vs_1f1b_spread``), and the modelled bubble (the lockstep model
   of `eqxzoo.parallel.Schedule`) with F = B = W = 1 (``schedule_bubble_fraction``) and with
   each action priced by its matrix FLOPs in the step's own traced program
   (``schedule_bubble_fraction_measured``, the costs in units of F in
   ``schedule_action_costs``: `eqxzoo.parallel.action_costs`; gpipe and circular, which
   have no such actions, priced by the 1F1B step's F and BW).
8. MoE at the cost of its active FLOPs, on one device: tokens/s of a top-2 dropless MoE train
   step over that of a dense model with the same active FLOPs (same attention and layers,
   SwiGLU MLP of width ``top_k * expert_mlp_dim``), at 8 experts of width 512 and 64
   fine-grained experts of width ``d_model / 2`` (OLMoE's ratio) (``moe_vs_dense_active``);
   the same for capacity routing (``moe_capacity_vs_dense_active``) and the dropless path's
   padding (``moe_padding_fraction``).
9. Expert dispatch: a compiled 64-expert top-6 MoE train step on 8 devices (``dp = 8 /
   ep``), the tokens exchanged with the experts' devices by all-to-all and, as before, held
   by every ep device with the output summed over ep: collective bytes per device per step
   (``moe_dispatch_bytes``: {"psum" | "all_to_all": {ep: bytes}} for ep 2, 4, 8), their
   kinds at ep 8 (``moe_dispatch_collectives``) and FLOPs per device
   (``moe_step_flops_per_device``, ``moe_step_flops_per_device_psum``: {ep: FLOPs}, ep 1
   too).
10. The loss at big vocabularies: compiled temporary bytes per device of the train step at
   T = 4096, d_model 512, 4 layers, vocabularies of 32k and 152k, with the plain loss (whole
   logits) and the fused chunked one (``loss_temp_bytes``: {"plain" | "chunked": {vocab:
   bytes}}).
11. Attention alone, forward and backward, q/k/v of (1, T, 8 heads, 64) in fp32, causal and
   with a 1024 window: the blockwise kernel, the dense one and PyTorch's
   ``F.scaled_dot_product_attention`` on CPU, timed in turn (``attention_fwd_bwd_s``:
   {kernel: {"causal" | "window": {T: seconds}}}), and our kernels' compiled temporary bytes
   (``attention_temp_bytes``).
12. The reference model's train step at T in {256, 1024, 2048} with B x T = 2048 against
   PyTorch eager (SDPA) side by side (``step_vs_pytorch_by_seq``: {T: ours / PyTorch's
   tokens/s}).
13. Long sequences split over cp: compiled temporary bytes per device of a dense model's
   train step (d_model 512, 4 layers, vocabulary 32k) on one sequence of 16,384 tokens per
   microbatch, on cp in 1, 2 and 4 devices (``cp_activation_bytes``: {cp: bytes}).

The pipeline efficiency (2.) times the dp8 and the pipelined steps in turn and reports the
median ratio and its spread over the rounds (``pp_efficiency_spread``: {schedule: [min,
max]}); the schedules (7.) are timed the same way against 1F1B; the comparisons with
PyTorch (5., 12.) also run both steps in turn and report the median of the rounds' ratios.

Each part is one row of `PARTS`: what it measures, what it prints and the JSON keys it
writes (the modules beside this one hold the measurements).

The parts that time one device (1., 5., 11., 12.) run in a process of one device, as
`pipelines.run` does on a one-device mesh: a process of 8 simulated CPU devices has 8 XLA
intra-op threads on the machine's cores, which made the one-device step 25% slower on 2
cores (`main` starts that process, ``EQXZOO_BENCH_DEVICES=1``).

Absolute times on a shared machine are noise; the ratios, measured in one run, are the result.
``--quick`` runs every part on a toy model with the fewest points of each sweep: it checks the
command and its JSON (the test suite runs it), not speed.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from eqxzoo.parallel.action_costs import cost_ratio  # noqa: E402
from eqxzoo.parallel.schedule import SCHEDULES as SCHEDULE_SPECS  # noqa: E402
from eqxzoo.train.report import measured_matmul_flops  # noqa: E402
from pipelines.bench.kernels import (  # noqa: E402
    attention_figures,
    context_memory,
    loss_memory,
)
from pipelines.bench.loader import loader_throughput  # noqa: E402
from pipelines.bench.moe import dispatch_figures, moe_figures  # noqa: E402
from pipelines.bench.schedules import schedule_figures  # noqa: E402
from pipelines.bench.throughput import (  # noqa: E402
    compile_times,
    memory_by_pp,
    pipeline_efficiency,
    single_device,
    step_by_seq,
)


@dataclasses.dataclass(frozen=True)
class Options:
    """What a part is measured with: timed steps per measurement, toy shapes (``quick``),
    the measured matmul peak (FLOP/s) and the parts chosen."""

    repeats: int
    quick: bool
    peak: float
    parts: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the benchmark: ``measure(options)`` returns its figures (the JSON ``keys``),
    ``report(figures)`` the lines it prints; ``one_device``: it times one device, in a
    process of one device (module docstring)."""

    name: str
    measure: Callable[[Options], dict]
    report: Callable[[dict], list[str]]
    keys: tuple[str, ...]
    one_device: bool = False


def _single(options: Options) -> dict:
    if "torch" in options.parts:
        return {}  # measured with PyTorch's step in turn, by the torch part
    return _with_mfu(single_device(options.repeats, options.quick), options.peak)


def _torch(options: Options) -> dict:
    return _with_mfu(
        single_device(options.repeats, options.quick, versus_pytorch=True), options.peak
    )


def _with_mfu(figures: dict, peak: float) -> dict:
    return {**figures, "mfu_vs_matmul": figures["model_flops_per_s"] / peak}


def _report_single(figures: dict) -> list[str]:
    return [
        f"single device: {figures['tokens_per_s']:.0f} tokens/s, "
        f"{figures['mfu_vs_matmul']:.2f} of matmul peak "
        f"({figures['matmul_peak_flops'] / 1e9:.1f} GFLOP/s)"
    ]


def _report_torch(figures: dict) -> list[str]:
    if figures["vs_pytorch"] is None:
        return [*_report_single(figures), "pytorch: not installed"]
    return [
        *_report_single(figures),
        f"pytorch eager: {figures['pytorch_tokens_per_s']:.0f} tokens/s; ours / pytorch "
        f"(median of interleaved rounds) = {figures['vs_pytorch']:.2f}",
    ]


def _report_pipeline(figures: dict) -> list[str]:
    spread = figures["pp_efficiency_spread"]
    return [
        "pipeline efficiency (dp2 x pp4 / dp8), median [min, max] over rounds: "
        + ", ".join(
            f"{name} {figures[f'pp_efficiency_{name}']:.2f} "
            f"[{spread[name][0]:.2f}, {spread[name][1]:.2f}]"
            for name in ("gpipe", "circular")
        )
    ]


def _report_loader(figures: dict) -> list[str]:
    return [
        f"data loader (tiny.toml batches): {figures['loader_tokens_per_s']:,.0f} tokens/s; "
        f"numpy memmap {figures['memmap_tokens_per_s']:,.0f}; tiny.toml's step consumes "
        f"{figures['tiny_step_tokens_per_s']:,.0f}: loader / step = "
        f"{figures['loader_vs_tiny_step']:.0f}x"
    ]


def _report_schedules(figures: dict) -> list[str]:
    spread = figures["schedule_tokens_per_s_vs_1f1b_spread"]
    lines = []
    for name, by_count in figures["schedule_activation_bytes"].items():
        first, last = min(by_count, key=int), max(by_count, key=int)
        low, high = spread[name]
        lines.append(
            f"schedule {name}: activation MB at M={'/'.join(by_count)} "
            + "/".join(f"{count / 1e6:.1f}" for count in by_count.values())
            + f" (M={last} / M={first} = {by_count[last] / by_count[first]:.2f}); "
            f"tokens/s at M={first} / 1f1b's, median [min, max] over rounds = "
            f"{figures['schedule_tokens_per_s_vs_1f1b'][name]:.2f} [{low:.2f}, {high:.2f}]; "
            f"modelled bubble (computed, lockstep) {figures['schedule_bubble_fraction'][name]:.3f} "
            "(F = B = W = 1), "
            f"{figures['schedule_bubble_fraction_measured'][name]:.3f} (priced by measured action FLOPs"
            + ("" if SCHEDULE_SPECS[name].fuses_backward else " of the 1f1b step")
            + f", {cost_ratio(figures['schedule_action_costs'][name])})"
        )
    return lines


def _report_moe(figures: dict) -> list[str]:
    lines = [
        f"moe {label} / dense of equal active FLOPs, by experts: "
        + ", ".join(f"{n}: {ratio:.2f}" for n, ratio in figures[name].items())
        for name, label in (
            ("moe_vs_dense_active", "dropless"),
            ("moe_capacity_vs_dense_active", "capacity"),
        )
    ]
    padding = figures["moe_padding_fraction"]
    lines.append(
        "moe dropless padding fraction (computed from the layout, not timed: CPU ragged_dot "
        "is emulated over every group, 1 - 1/E), by experts: "
        + ", ".join(f"{n}: {value:.3f}" for n, value in padding.items())
    )
    return lines


def _report_dispatch(figures: dict) -> list[str]:
    by_design = figures["moe_dispatch_bytes"]
    flops = figures["moe_step_flops_per_device"]
    psum_flops = figures["moe_step_flops_per_device_psum"]
    return [
        "moe expert dispatch (dp = devices / ep): collective MiB per device per step, "
        "psum / all-to-all, by ep: "
        + ", ".join(
            f"{ep}: {psum / 2**20:.1f} / {by_design['all_to_all'][ep] / 2**20:.1f} "
            f"({by_design['all_to_all'][ep] / psum:.2f}x)"
            for ep, psum in by_design["psum"].items()
        ),
        "moe step FLOPs per device over ep 1's, all-to-all / psum, by ep: "
        + ", ".join(
            f"{ep}: {flops[ep] / flops['1']:.2f} / {psum_flops[ep] / psum_flops['1']:.2f}"
            for ep in by_design["psum"]
        ),
    ]


def _report_context(figures: dict) -> list[str]:
    by_shards = figures["cp_activation_bytes"]
    whole = by_shards["1"]
    return [
        "cp: train-step temp MB per device by cp "
        + ", ".join(f"{cp}: {size / 1e6:.0f}" for cp, size in by_shards.items())
        + "; over cp 1: "
        + ", ".join(f"{cp}: {size / whole:.2f}" for cp, size in by_shards.items())
    ]


def _report_loss(figures: dict) -> list[str]:
    by_loss = figures["loss_temp_bytes"]
    lines = [
        f"loss {name}: train-step temp MB by vocab "
        + ", ".join(f"{vocab}: {size / 1e6:.0f}" for vocab, size in by_vocab.items())
        for name, by_vocab in by_loss.items()
    ]
    largest, smallest = max(by_loss["plain"], key=int), min(by_loss["plain"], key=int)
    lines.append(
        f"loss: plain / chunked temp at vocab {largest} = "
        f"{by_loss['plain'][largest] / by_loss['chunked'][largest]:.1f}x; chunked temp at "
        f"{largest} / at {smallest} = "
        f"{by_loss['chunked'][largest] / by_loss['chunked'][smallest]:.2f}"
    )
    return lines


def _report_attention(figures: dict) -> list[str]:
    lines = []
    for mask in ("causal", "window"):
        for kernel, by_mask in figures["attention_fwd_bwd_s"].items():
            lines.append(
                f"attention fwd+bwd {mask} {kernel}: seconds by T "
                + ", ".join(f"{seq}: {value:.3f}" for seq, value in by_mask[mask].items())
            )
        for kernel, by_mask in figures["attention_temp_bytes"].items():
            lines.append(
                f"attention fwd+bwd {mask} {kernel}: temp MB by T "
                + ", ".join(f"{seq}: {value / 1e6:.0f}" for seq, value in by_mask[mask].items())
            )
    return lines


def _report_seq(figures: dict) -> list[str]:
    by_seq = figures["step_vs_pytorch_by_seq"]
    measured = (
        "not measured"
        if by_seq is None
        else ", ".join(f"{seq}: {ratio:.2f}" for seq, ratio in by_seq.items())
    )
    return [f"train step ours / pytorch eager tokens/s by T (B x T fixed): {measured}"]


SINGLE_KEYS = ("tokens_per_s", "model_flops_per_token", "model_flops_per_s", "mfu_vs_matmul")
PARTS: dict[str, Part] = {
    part.name: part
    for part in (
        Part("single", _single, _report_single, SINGLE_KEYS, one_device=True),
        Part(
            "pipeline",
            lambda o: pipeline_efficiency(o.repeats, o.quick),
            _report_pipeline,
            (
                "dp8_tokens_per_s",
                "pp_efficiency_gpipe",
                "pp_efficiency_circular",
                "pp_efficiency_spread",
            ),
        ),
        Part(
            "compile",
            lambda o: {"compile_s_by_layers": compile_times(o.quick)},
            lambda f: [
                "compile seconds by layers: "
                + str({k: round(v, 2) for k, v in f["compile_s_by_layers"].items()})
            ],
            ("compile_s_by_layers",),
        ),
        Part(
            "memory",
            lambda o: {"memory_bytes_by_pp": memory_by_pp(o.quick)},
            lambda f: [f"per-device bytes by pp: {f['memory_bytes_by_pp']}"],
            ("memory_bytes_by_pp",),
        ),
        Part(
            "torch",
            _torch,
            _report_torch,
            (*SINGLE_KEYS, "vs_pytorch"),
            one_device=True,
        ),
        Part(
            "loader",
            lambda o: loader_throughput(o.repeats, o.quick),
            _report_loader,
            (
                "loader_tokens_per_s",
                "memmap_tokens_per_s",
                "tiny_step_tokens_per_s",
                "loader_vs_tiny_step",
            ),
        ),
        Part(
            "schedules",
            lambda o: schedule_figures(o.repeats, o.quick),
            _report_schedules,
            (
                "schedule_activation_bytes",
                "schedule_tokens_per_s",
                "schedule_tokens_per_s_vs_1f1b",
                "schedule_tokens_per_s_vs_1f1b_spread",
                "schedule_bubble_fraction",
                "schedule_bubble_fraction_measured",
                "schedule_action_costs",
            ),
        ),
        Part(
            "moe",
            lambda o: moe_figures(o.repeats, o.quick),
            _report_moe,
            ("moe_vs_dense_active", "moe_capacity_vs_dense_active", "moe_padding_fraction"),
        ),
        Part(
            "dispatch",
            lambda o: dispatch_figures(o.quick),
            _report_dispatch,
            (
                "moe_dispatch_bytes",
                "moe_dispatch_collectives",
                "moe_step_flops_per_device",
                "moe_step_flops_per_device_psum",
            ),
        ),
        Part("loss", lambda o: loss_memory(o.quick), _report_loss, ("loss_temp_bytes",)),
        Part(
            "context",
            lambda o: context_memory(o.quick),
            _report_context,
            ("cp_activation_bytes",),
        ),
        Part(
            "attention",
            lambda o: attention_figures(o.repeats, o.quick),
            _report_attention,
            ("attention_fwd_bwd_s", "attention_temp_bytes"),
            one_device=True,
        ),
        Part(
            "seq",
            lambda o: step_by_seq(o.repeats, o.quick),
            _report_seq,
            ("step_vs_pytorch_by_seq",),
            one_device=True,
        ),
    )
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", metavar="FILE", help="also write the figures as one JSON object")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed steps per measurement (median)"
    )
    parser.add_argument("--only", choices=list(PARTS), action="append")
    parser.add_argument(
        "--quick", action="store_true", help="a toy model: checks the command, not speed"
    )
    args = parser.parse_args(argv)
    parts = frozenset(args.only or PARTS)
    figures: dict = {}
    elsewhere = (
        {name for name in parts if PARTS[name].one_device} if jax.device_count() > 1 else set()
    )
    if elsewhere:
        figures |= _on_one_device(sorted(elsewhere), repeats=args.repeats, quick=args.quick)
    here = parts - elsewhere
    peak = figures.get("matmul_peak_flops") or measured_matmul_flops(
        repeats=args.repeats, size=256 if args.quick else 2048
    )
    options = Options(repeats=args.repeats, quick=args.quick, peak=peak, parts=parts)
    figures["matmul_peak_flops"] = peak
    for part in PARTS.values():
        if part.name in here:
            measured = part.measure(options)
            figures.update(measured)
            if measured:
                for line in part.report(figures):
                    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


DEVICES_ENV = "EQXZOO_BENCH_DEVICES"


def _on_one_device(parts: list[str], *, repeats: int, quick: bool) -> dict:
    """The figures of ``parts`` measured by ``python -m pipelines.bench`` in a process of one
    device, its lines printed here."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "one_device.json"
        args = [sys.executable, "-m", "pipelines.bench", "--repeats", str(repeats)]
        args += [*(f"--only={name}" for name in parts), "--json", str(out)]
        args += ["--quick"] if quick else []
        child = subprocess.run(
            args, env=os.environ | {DEVICES_ENV: "1"}, capture_output=True, text=True
        )
        if child.returncode != 0:
            raise RuntimeError(f"the one-device parts failed:\n{child.stderr[-3000:]}")
        print(child.stdout, end="")
        return json.loads(out.read_text())
