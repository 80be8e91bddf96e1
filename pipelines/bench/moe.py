"""MoE at the cost of its active FLOPs, and what its expert dispatch communicates."""

import dataclasses

import models
from eqxzoo.nn import RoutingMode
from eqxzoo.parallel import MeshConfig, Schedule
from eqxzoo.parallel.collectives import collective_traffic
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


DISPATCH_MESH = MeshConfig(dp=2, pp=2, ep=2)


DISPATCH_EXPERTS, QUICK_DISPATCH_EXPERTS = 64, 8


def dispatch_figures(quick: bool) -> dict:
    """The collectives of a compiled pipelined train step of a top-2 dropless MoE with 64
    experts (width 128, the reference sizes otherwise) on dp2 x pp2 x ep2, GPipe over 4
    microbatches: counts and buffer bytes per step by kind (`eqxzoo.parallel.collectives`).
    Compiled only, not run."""
    sizes = QUICK if quick else REFERENCE
    batch, seq = batch_and_seq(quick)
    n_experts = QUICK_DISPATCH_EXPERTS if quick else DISPATCH_EXPERTS
    moe = models.MoEConfig(n_experts=n_experts, top_k=2, expert_mlp_dim=128)
    runner = StepRunner(
        models.MixtralConfig(**sizes, moe=moe),
        DISPATCH_MESH,
        Schedule("gpipe", DISPATCH_MESH.pp, 4, 1),
        (1, 4, batch, seq),
    )
    traffic = collective_traffic(runner.compiled.as_text())
    return {
        "moe_dispatch_collectives": {
            **{kind: dataclasses.asdict(t) for kind, t in sorted(traffic.items())},
            "total_bytes": sum(t.bytes for t in traffic.values()),
        }
    }
