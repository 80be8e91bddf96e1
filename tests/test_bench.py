"""`python -m pipelines.bench --json FILE` writes every figure scripts depend on."""

import json
import subprocess
import sys

import pytest

KEYS = {
    "tokens_per_s": float,
    "model_flops_per_token": float,
    "matmul_peak_flops": float,
    "mfu_vs_matmul": float,
    "pp_efficiency_gpipe": float,
    "pp_efficiency_circular": float,
    "compile_s_by_layers": dict,
    "memory_bytes_by_pp": dict,
    "loader_tokens_per_s": float,
    "memmap_tokens_per_s": float,
    "tiny_step_tokens_per_s": float,
    "loader_vs_tiny_step": float,
    "schedule_activation_bytes": dict,
    "schedule_tokens_per_s": dict,
    "schedule_bubble_fraction": dict,
    "moe_vs_dense_active": dict,
    "moe_capacity_vs_dense_active": dict,
    "moe_padding_fraction": dict,
    "moe_dispatch_collectives": dict,
    "pp_efficiency_spread": dict,
    "loss_temp_bytes": dict,
    "attention_fwd_bwd_s": dict,
    "attention_temp_bytes": dict,
    "step_vs_pytorch_by_seq": dict,
}
SCHEDULES = {"gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1"}


@pytest.mark.slow
def test_bench_json_has_every_key(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.bench", "--quick", "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    for key, kind in KEYS.items():
        assert isinstance(figures[key], kind), key
    assert "vs_pytorch" in figures
    assert set(figures["compile_s_by_layers"]) == {"4", "16", "64"}
    assert set(figures["memory_bytes_by_pp"]) == {"1", "2", "4"}
    memory = figures["memory_bytes_by_pp"]
    assert memory["4"] < memory["1"]
    assert "pipeline efficiency" in result.stdout
    assert "data loader (tiny.toml batches)" in result.stdout
    assert set(figures["schedule_activation_bytes"]) == SCHEDULES
    assert all(
        set(by_m) == {"8", "16", "32"} for by_m in figures["schedule_activation_bytes"].values()
    )
    assert (
        set(figures["schedule_tokens_per_s"])
        == set(figures["schedule_bubble_fraction"])
        == SCHEDULES
    )
    for key in ("moe_vs_dense_active", "moe_capacity_vs_dense_active", "moe_padding_fraction"):
        assert set(figures[key]) == {"8", "64"}, key
    assert all(0.0 < fraction < 1.0 for fraction in figures["moe_padding_fraction"].values())
    dispatch = figures["moe_dispatch_collectives"]
    assert dispatch["total_bytes"] == sum(
        by_kind["bytes"] for name, by_kind in dispatch.items() if name != "total_bytes"
    )
    assert dispatch["total_bytes"] > 0
    bubble = figures["schedule_bubble_fraction"]
    assert bubble["zb_h1"] <= bubble["1f1b"] / 2
    spread = figures["pp_efficiency_spread"]
    for name in ("gpipe", "circular"):
        low, high = spread[name]
        assert low <= figures[f"pp_efficiency_{name}"] <= high, name
    assert set(figures["loss_temp_bytes"]) == {"plain", "chunked"}
    assert all(set(by_vocab) == {"512", "2048"} for by_vocab in figures["loss_temp_bytes"].values())
    attention = figures["attention_fwd_bwd_s"]
    assert set(attention) == {"blockwise", "dense", "pytorch"}
    assert set(attention["blockwise"]["causal"]) == {"64", "128", "256"}
    assert set(attention["dense"]["window"]) == set(attention["pytorch"]["window"]) == {"64", "128"}
    assert set(figures["step_vs_pytorch_by_seq"]) == {"16", "32"}
