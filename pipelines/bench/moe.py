"""MoE at the cost of its active FLOPs, and what its expert dispatch communicates."""

import copy
import dataclasses

import models
from eqxzoo.nn import RoutingMode
from eqxzoo.parallel import MeshConfig, Schedule
from eqxzoo.parallel.collectives import collective_traffic
from eqxzoo.parallel.rules import ShardingConfig
from pipelines.bench.common import (
    QUICK,
    REFERENCE,
    StepRunner,
    batch_and_seq,
    interleaved_seconds,
)

MOE_EXPERTS = {8: 512, 64: 128}  # n_experts: expert_mlp_dim at d_model 256; top-2


QUICK_MOE_EXPERTS = {8: 16}


def moe_configs(
    n_experts: int, routing: RoutingMode, *, quick: bool
) -> tuple[models.DecoderConfig, models.DecoderConfig]:
    """A top-2 Mixtral-style MoE with ``n_experts`` experts and the dense SwiGLU model of
    the same active FLOPs (the reference sizes, RMSNorm; 2 layers with --quick)."""
    sizes = {**(QUICK if quick else REFERENCE), **({"n_layers": 2} if quick else {})}
    expert_mlp_dim = (QUICK_MOE_EXPERTS if quick else MOE_EXPERTS)[n_experts]
    moe = models.MoEConfig(
        n_experts=n_experts, top_k=2, expert_mlp_dim=expert_mlp_dim, routing=routing
    )
    dense = models.LlamaConfig(**{**sizes, "mlp_dim": moe.top_k * expert_mlp_dim})
    return models.MixtralConfig(**{**sizes, "moe": moe}), dense


def moe_figures(repeats: int, quick: bool) -> dict:
    """Dropless and capacity MoE train steps over the dense step of equal active FLOPs,
    their steps timed in turn (round-robin) so that a slow spell of a shared machine slows
    all three alike; and the dropless step's padding fraction."""
    batch, seq = batch_and_seq(quick)
    result: dict[str, dict[str, float]] = {
        "moe_vs_dense_active": {},
        "moe_capacity_vs_dense_active": {},
        "moe_padding_fraction": {},
    }

    def one_device(config) -> StepRunner:
        shape = (1, 1, batch, seq)
        return StepRunner(
            config, MeshConfig(), Schedule("gpipe", 1, 1, 1), shape, remat_stages=False
        )

    dense_runner: tuple[models.DecoderConfig, StepRunner] | None = None
    for n_experts in QUICK_MOE_EXPERTS if quick else MOE_EXPERTS:
        dropless, dense = moe_configs(n_experts, "dropless", quick=quick)
        capacity, _ = moe_configs(n_experts, "capacity", quick=quick)
        if dense_runner is None or dense_runner[0] != dense:
            dense_runner = None  # frees the previous dense model before the next is built
            dense_runner = (dense, one_device(dense))
        steps = {
            "dense": dense_runner[1],
            "dropless": one_device(dropless),
            "capacity": one_device(capacity),
        }
        seconds = interleaved_seconds({name: r.step for name, r in steps.items()}, repeats)
        key = str(n_experts)
        result["moe_vs_dense_active"][key] = seconds["dense"] / seconds["dropless"]
        result["moe_capacity_vs_dense_active"][key] = seconds["dense"] / seconds["capacity"]
        result["moe_padding_fraction"][key] = float(steps["dropless"].metrics["padding_fraction"])
    return result


DISPATCH_DEVICES, DISPATCH_EXPERT_DEVICES = 8, (1, 2, 4, 8)
DISPATCH_EXPERTS, DISPATCH_TOP_K = 64, 6
QUICK_DISPATCH = dict(devices=2, expert_devices=(1, 2), experts=8, top_k=2)


def psum_design(sharding: ShardingConfig) -> ShardingConfig:
    """The rules of the design expert parallelism replaced: the batch split over ``dp``
    only, so that every ``ep`` device holds the same tokens, computes its own experts on all
    of them and the layer's output is summed over ``ep``. A run's rules fix the batch over
    ``dp`` and ``ep`` (`eqxzoo.parallel.rules.FIXED_RULES`); the bench builds these past that
    check, to measure what the change bought."""
    rules = copy.copy(sharding)
    object.__setattr__(rules, "batch", ("dp",))
    return rules


def dispatch_figures(quick: bool) -> dict:
    """A compiled train step of a dropless MoE with 64 experts top-6 (width 128, the
    reference sizes otherwise; 8 top-2 with --quick) on 8 devices, ``dp = 8 / ep``, one
    stage, the same global batch, compiled only: the bytes of its collectives per device per
    step (`eqxzoo.parallel.collectives`: the costlier branch of a conditional, so the
    all-to-all design's worst-case exchange) in both designs (``moe_dispatch_bytes``:
    {"psum" | "all_to_all": {ep: bytes}}), their kinds at the largest ep
    (``moe_dispatch_collectives``), and the FLOPs per device of the compiled step
    (``moe_step_flops_per_device``, all-to-all; ``moe_step_flops_per_device_psum``: {ep:
    FLOPs}, ep 1 being dp alone)."""
    sizes = QUICK if quick else REFERENCE
    batch, seq = batch_and_seq(quick)
    devices = QUICK_DISPATCH["devices"] if quick else DISPATCH_DEVICES
    expert_devices = QUICK_DISPATCH["expert_devices"] if quick else DISPATCH_EXPERT_DEVICES
    moe = models.MoEConfig(
        n_experts=QUICK_DISPATCH["experts"] if quick else DISPATCH_EXPERTS,
        top_k=QUICK_DISPATCH["top_k"] if quick else DISPATCH_TOP_K,
        expert_mlp_dim=128,
    )
    model = models.MixtralConfig(**sizes, moe=moe)
    shape = (1, 1, max(batch, devices), seq)
    designs = {
        "all_to_all": {},
        "psum": {"sharding": psum_design(ShardingConfig()), "split_experts": False},
    }
    result: dict[str, dict] = {
        "moe_dispatch_bytes": {name: {} for name in designs},
        "moe_dispatch_collectives": {},
        "moe_step_flops_per_device": {},
        "moe_step_flops_per_device_psum": {},
    }
    flops_keys = {
        "all_to_all": "moe_step_flops_per_device",
        "psum": "moe_step_flops_per_device_psum",
    }
    for ep in expert_devices:
        mesh = MeshConfig(dp=devices // ep, ep=ep)
        for name, options in designs.items():
            if ep == 1 and name == "psum":
                continue  # one design without expert parallelism: the all-to-all's ep 1
            runner = StepRunner(
                model, mesh, Schedule("gpipe", 1, 1, 1), shape, compile_only=True, **options
            )
            traffic = collective_traffic(runner.compiled.as_text())
            flops = float(runner.compiled.cost_analysis()["flops"])
            if ep == 1:
                for key in flops_keys.values():
                    result[key]["1"] = flops
                continue
            result["moe_dispatch_bytes"][name][str(ep)] = sum(t.bytes for t in traffic.values())
            result[flops_keys[name]][str(ep)] = flops
            if ep == expert_devices[-1]:
                result["moe_dispatch_collectives"][name] = {
                    kind: dataclasses.asdict(t) for kind, t in sorted(traffic.items())
                }
    return result
