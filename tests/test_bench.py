"""`python -m pipelines.bench --quick` runs every part and writes every figure scripts depend
on: one test per part (``--only PART --json FILE``, in this process), on toy shapes with the
fewest points of each sweep. Speed is the benchmark's business, not the suite's."""

import json

import pytest

from eqxzoo.parallel import MeshConfig, Schedule
from eqxzoo.parallel.collectives import permutes_in_branches
from pipelines import bench
from pipelines.bench import kernels, moe, schedules, throughput
from pipelines.bench.common import StepRunner, batch_and_seq, reference_config


def keys(numbers) -> set[str]:
    return {str(number) for number in numbers}


SCHEDULES = set(schedules.QUICK_SCHEDULES)
MOE_KEYS = ("moe_vs_dense_active", "moe_capacity_vs_dense_active", "moe_padding_fraction")


def check_single(figures: dict) -> None:
    for key in ("tokens_per_s", "model_flops_per_token", "mfu_vs_matmul"):
        assert isinstance(figures[key], float), key


def check_torch(figures: dict) -> None:
    check_single(figures)
    assert isinstance(figures["vs_pytorch"], float)
    assert isinstance(figures["pytorch_tokens_per_s"], float)


def check_pipeline(figures: dict) -> None:
    spread = figures["pp_efficiency_spread"]
    for name in ("gpipe", "circular"):
        low, high = spread[name]
        assert low <= figures[f"pp_efficiency_{name}"] <= high, name


def check_compile(figures: dict) -> None:
    assert set(figures["compile_s_by_layers"]) == keys(throughput.QUICK_COMPILE_LAYERS)


def check_memory(figures: dict) -> None:
    memory = figures["memory_bytes_by_pp"]
    assert set(memory) == keys(throughput.QUICK_MEMORY_PP)
    assert memory["2"] < memory["1"]


def check_loader(figures: dict) -> None:
    for key in ("loader_tokens_per_s", "memmap_tokens_per_s", "tiny_step_tokens_per_s"):
        assert figures[key] > 0, key
    assert isinstance(figures["loader_vs_tiny_step"], float)


def check_schedules(figures: dict) -> None:
    assert set(figures["schedule_activation_bytes"]) == SCHEDULES
    for by_m in figures["schedule_activation_bytes"].values():
        assert set(by_m) == keys(schedules.QUICK_SCHEDULE_MICROBATCHES)
    for key in (
        "schedule_tokens_per_s",
        "schedule_tokens_per_s_vs_1f1b",
        "schedule_bubble_fraction",
        "schedule_bubble_fraction_measured",
        "schedule_action_costs",
    ):
        assert set(figures[key]) == SCHEDULES, key
    spread = figures["schedule_tokens_per_s_vs_1f1b_spread"]
    for name, ratio in figures["schedule_tokens_per_s_vs_1f1b"].items():
        low, high = spread[name]
        assert low <= ratio <= high, name
    assert figures["schedule_tokens_per_s_vs_1f1b"]["1f1b"] == 1.0
    for name, costs in figures["schedule_action_costs"].items():
        assert set(costs) == {"F", "B", "W", "BW", "R"} and costs["F"] == 1.0, name
        assert 0.0 <= figures["schedule_bubble_fraction_measured"][name] < 1.0, name
    # With stage remat zb_v's R recomputes the forward (1F1B's BW does so itself).
    assert figures["schedule_action_costs"]["zb_v"]["R"] == 1.0
    assert figures["schedule_action_costs"]["1f1b"]["R"] is None


def check_moe(figures: dict) -> None:
    for key in MOE_KEYS:
        assert set(figures[key]) == keys(moe.QUICK_MOE_EXPERTS), key
    assert all(0.0 < fraction < 1.0 for fraction in figures["moe_padding_fraction"].values())


def check_dispatch(figures: dict) -> None:
    expert_devices = moe.QUICK_DISPATCH["expert_devices"]
    by_design = figures["moe_dispatch_bytes"]
    assert set(by_design) == {"psum", "all_to_all"}
    for design, by_ep in by_design.items():
        assert set(by_ep) == keys(expert_devices[1:]), design
        kinds = figures["moe_dispatch_collectives"][design]
        assert by_ep[str(expert_devices[-1])] == sum(t["bytes"] for t in kinds.values()) > 0
    assert "all-to-all" in figures["moe_dispatch_collectives"]["all_to_all"]
    for key in ("moe_step_flops_per_device", "moe_step_flops_per_device_psum"):
        assert set(figures[key]) == keys(expert_devices), key


def check_loss(figures: dict) -> None:
    by_loss = figures["loss_temp_bytes"]
    assert set(by_loss) == {"plain", "chunked"}
    for by_vocab in by_loss.values():
        assert set(by_vocab) == keys(kernels.QUICK_LOSS["vocabs"])


def check_context(figures: dict) -> None:
    by_shards = figures["cp_activation_bytes"]
    assert set(by_shards) == keys(kernels.CONTEXT_SHARDS)
    assert by_shards["4"] < by_shards["2"] < by_shards["1"], "splitting the sequence saves memory"


def check_attention(figures: dict) -> None:
    seconds, temp = figures["attention_fwd_bwd_s"], figures["attention_temp_bytes"]
    every_seq = keys((*kernels.QUICK_ATTENTION["seqs"], *kernels.QUICK_ATTENTION["blockwise_only"]))
    assert set(seconds) == {"blockwise", "dense", "pytorch"}
    assert set(temp) == {"blockwise", "dense"}
    assert set(seconds["blockwise"]["causal"]) == set(temp["blockwise"]["window"]) == every_seq
    dense_seqs = keys(kernels.QUICK_ATTENTION["seqs"])
    assert set(seconds["dense"]["window"]) == set(seconds["pytorch"]["causal"]) == dense_seqs


def check_seq(figures: dict) -> None:
    assert set(figures["step_vs_pytorch_by_seq"]) == keys(throughput.QUICK_STEP_SEQS)


CHECKS = {
    "single": check_single,
    "torch": check_torch,
    "pipeline": check_pipeline,
    "compile": check_compile,
    "memory": check_memory,
    "loader": check_loader,
    "schedules": check_schedules,
    "moe": check_moe,
    "dispatch": check_dispatch,
    "loss": check_loss,
    "context": check_context,
    "attention": check_attention,
    "seq": check_seq,
}


def test_every_part_is_checked():
    assert set(CHECKS) == set(bench.PARTS)


# The parts that time one device run together, in the one process of one device they start.
ONE_DEVICE = tuple(name for name, part in bench.PARTS.items() if part.one_device)
GROUPS = [ONE_DEVICE, *((name,) for name in bench.PARTS if name not in ONE_DEVICE)]


@pytest.mark.slow
@pytest.mark.parametrize("parts", GROUPS, ids="+".join)
def test_bench_parts_write_their_json_keys(parts, tmp_path, capsys):
    out = tmp_path / "bench.json"
    only = [f"--only={part}" for part in parts]
    returned = bench.main(["--quick", "--repeats", "1", *only, "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures == json.loads(json.dumps(returned))
    assert isinstance(figures["matmul_peak_flops"], float)
    printed = capsys.readouterr().out
    for part in parts:
        assert set(bench.PARTS[part].keys) <= set(figures), f"{part} writes its row's keys"
        CHECKS[part](figures)
    assert printed.strip(), "every part prints its figures"
    if parts == ONE_DEVICE:
        assert "single device: " in printed and "pytorch eager: " in printed


def test_the_reference_pipelined_step_leaves_no_permute_in_a_branch():
    """The benchmark's dp2 x pp4 step at the reference sizes (the partitioner's choices
    depend on them: ``--quick``'s differ) compiles without a collective-permute inside the
    stages' bubble-skipping branch, where XLA:CPU hangs: LayerNorm statistics summed by
    folding the features in halves once put some there."""
    batch, seq = batch_and_seq(quick=False)
    runner = StepRunner(
        reference_config(),
        MeshConfig(dp=2, pp=4),
        Schedule("gpipe", 4, 8, 1),
        (1, 8, batch, seq),
        compile_only=True,
    )
    assert permutes_in_branches(runner.compiled.as_text()) == []
