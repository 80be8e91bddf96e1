"""`python -m pipelines.run` end to end: exact resume after SIGKILL/SIGTERM, resume on another
mesh, the same losses for pp = 1, 2, 4, non-finite stops, dry run, config errors.

Runs `configs/tiny.toml` shrunk by ``--set`` overrides, as subprocesses (each with its own 8
simulated CPU devices) sharing one compilation cache.
"""

import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from runs import (
    GPIPE,
    SMALL,
    TINY,
    losses,
    records,
    run,
    run_command,
    start_and_signal,
    stopped_copy,
)

from eqxzoo.parallel import make_mesh
from eqxzoo.run.config import load_config, model_config_for_mesh, step_config
from eqxzoo.run.plan import sharding_table
from eqxzoo.train.state import abstract_train_state
from models import model_factory
from pipelines.run import main

pytestmark = pytest.mark.slow


def test_reference_run_reports_every_step(reference: list[dict]):
    steps = [r for r in reference if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for name in ("loss", "grad_norm", "lr", "tokens_per_s", "skipped", "expert_load", "mfu"):
        assert all(name in r for r in steps), name
    # The plain corpus masks no target: every token counts.
    tokens = load_config(TINY, list(SMALL)).tokens_per_step
    assert {(r["target_tokens"], r["masked_fraction"]) for r in steps} == {(tokens, 0.0)}
    assert [r["step"] for r in reference if "val_loss" in r] == [3, 6]


def test_sigterm_saves_and_exits_then_sigkill_and_a_rerun_reproduce_the_losses_exactly(
    reference: list[dict], tmp_path: Path, cache_dir: Path
):
    """SIGTERM once step 2 is logged saves a checkpoint and exits 0; the run started again
    resumes from it and is SIGKILLed once it has logged a step of its own (before its last),
    which leaves its lock file (not its lock); the rerun resumes from the newest checkpoint.
    The losses are those of the run that never stopped. (One run carries both signals: each
    alone cost a run's start and steps more.)"""
    run_dir = tmp_path / "run"
    code, output = start_and_signal(run_dir, cache_dir, 2, signal.SIGTERM)
    assert code == 0, output[-3000:]
    saved = re.search(r"stopped by a signal: checkpoint saved at step (\d+)", output)
    assert saved and int(saved[1]) <= 4, output[-3000:]
    code, _ = start_and_signal(run_dir, cache_dir, int(saved[1]) + 1, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert (run_dir / "run.lock").exists(), "the lock file stays, its lock is gone"
    result = run(run_dir, cache_dir)
    assert "resumed from the checkpoint at step" in result.stdout
    assert losses(run_dir) == [r["loss"] for r in reference if "loss" in r]


def test_resume_on_another_mesh(
    reference: list[dict], reference_dir: Path, tmp_path: Path, cache_dir: Path
):
    """The reference, saved at step 4 on dp2 x pp2 x tp2 (circular, R=2), resumed on
    pp4 x cp2 (GPipe, whole layers per stage, each sequence split over cp with ring attention
    between the shards): the losses of the run that never stopped."""
    run_dir = stopped_copy(reference_dir, tmp_path / "run", last_step=4)
    overrides = (*GPIPE, "mesh.dp=1", "mesh.pp=4", "mesh.tp=1", "mesh.cp=2")
    result = run(run_dir, cache_dir, overrides=overrides)
    assert "resumed from the checkpoint at step 4" in result.stdout
    expected = [r["loss"] for r in reference if "loss" in r]
    np.testing.assert_allclose(losses(run_dir), expected, rtol=1e-5)


# configs/tiny.toml made DeepSeek-V3-shaped: one dense prefix layer before 4 MoE blocks,
# latent attention, group-limited sigmoid routing whose balancing biases move every step.
DEEPSEEK = (
    "model.family=deepseek_v3",
    "model.n_layers=5",
    "model.first_dense_layers=1",
    "model.mlp_dim=64",
    "model.moe.shared_gate=false",
    "model.moe.scoring=sigmoid",
    "model.moe.selection_bias=true",
    "model.moe.n_groups=2",
    "model.moe.topk_groups=1",
    "model.moe.normalize_topk=true",
    "model.latent_attention.q_lora_rank=16",
    "model.latent_attention.kv_lora_rank=16",
    "model.latent_attention.qk_nope_head_dim=8",
    "model.latent_attention.qk_rope_head_dim=8",
    "model.latent_attention.v_head_dim=8",
    "loss.bias_update_rate=0.01",
    "run.eval_every=0",
)


def test_a_model_with_a_prefix_resumes_on_another_pp(tmp_path: Path, cache_dir: Path):
    """Saved at step 2 on tiny.toml's dp2 x pp2 x tp2 (circular, R=2; latent attention on
    dp and tp, where XLA:CPU's partitioner moved weights by collective-permutes inside the
    stage while dp was its own in the pipeline's region: the stages skip their bubbles now
    that the region is manual over dp), resumed on dp2 x pp1 x tp2 x ep2
    (the experts split over ep, tokens exchanged by all-to-all): the losses of the run that
    never stopped; the resumed step reports how evenly the ep devices received tokens; the
    dry run's table lists the prefix's arrays."""
    no_eval = (*DEEPSEEK, "run.eval_every=0")
    whole = run(tmp_path / "whole", cache_dir, overrides=no_eval, extra=("--steps", "3"))
    assert "note: the stages compute through their bubbles" not in whole.stdout
    split = stopped_copy(tmp_path / "whole", tmp_path / "split", last_step=2)
    result = run(
        split, cache_dir, overrides=(*no_eval, "mesh.pp=1", "mesh.ep=2"), extra=("--steps", "3")
    )
    assert "resumed from the checkpoint at step 2" in result.stdout
    expected = losses(tmp_path / "whole")
    assert len(expected) == 3
    (resumed,) = [r for r in records(split) if "loss" in r and r["step"] == 3]
    assert 1.0 <= resumed["device_load_max"] <= 2.0, resumed
    np.testing.assert_allclose(losses(split), expected, rtol=1e-5)
    config = load_config(TINY, [*SMALL, *DEEPSEEK])
    make_model = model_factory(model_config_for_mesh(config.model, config.mesh))
    state = abstract_train_state(
        make_model, config=step_config(config), mesh=make_mesh(config.mesh)
    )
    shapes = {name: shape for name, shape, *_ in sharding_table(state)}
    assert shapes["prefix.layers.attention.wkv_b"] == "1x16x4x16"
    assert "blocks.layers.mlp.router.selection_bias" in shapes


def test_one_stage_with_split_sequences_and_experts_gives_the_same_losses(
    reference: list[dict], tmp_path: Path, cache_dir: Path
):
    """pp=2 is the reference run (circular, R=2, dp=2); pp=1 with ep=2 in dp's place (each
    ep device routes its own sequences and exchanges their tokens with the experts' devices)
    and each sequence split over cp (ep2 x tp2 x cp2, ring attention in the layers' own
    region) runs GPipe on the same batches: the same losses. (pp=4, also with cp=2:
    `test_resume_on_another_mesh`.)"""
    expected = [r["loss"] for r in reference if "loss" in r][:4]
    run_dir = tmp_path / "pp1-ep2-cp2"
    overrides = (*GPIPE, "mesh.dp=1", "mesh.ep=2", "mesh.pp=1", "mesh.cp=2", "run.eval_every=0")
    run(run_dir, cache_dir, overrides=overrides, extra=("--steps", "4"))
    np.testing.assert_allclose(losses(run_dir), expected, rtol=1e-5)


def test_zero_bubble_v_gives_the_reference_losses_and_resumes(
    reference: list[dict], tmp_path: Path, cache_dir: Path
):
    """The reference runs circular (R=2); zb_v (its layers placed in a V) on the same mesh
    and batches gives its losses through `pipelines.run`, also across a resume (its
    checkpoint holds the layers in order and comes back in the V), and its dry run reports
    the modelled bubble. (The other schedules of the family run the same executor:
    `test_pipeline.py` compares each with the sequential model on many meshes,
    `test_finetune_parity.py` 1f1b and zb_h1 with PyTorch.)"""
    expected = [r["loss"] for r in reference if "loss" in r][:3]
    zero_bubble = ("pipeline.schedule=zb_v", "pipeline.repeats=2", "run.eval_every=0")
    run_dir = tmp_path / "zb_v"
    run(run_dir, cache_dir, overrides=zero_bubble, extra=("--steps", "2"))
    resumed = run(run_dir, cache_dir, overrides=zero_bubble, extra=("--steps", "3"))
    assert "resumed from the checkpoint at step 2" in resumed.stdout
    np.testing.assert_allclose(losses(run_dir), expected, rtol=1e-5)
    planned = run(tmp_path / "dry", cache_dir, overrides=zero_bubble, extra=("--dry-run",))
    assert re.search(
        r"schedule zb_v: P=2 stages, M=2 microbatches, R=2 repeats; modelled bubble 7\.7%",
        planned.stdout,
    ), planned.stdout
    assert "at most 4 microbatch chunks in flight per stage" in planned.stdout


def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path: Path, cache_dir: Path):
    overrides = ("optimizer.learning_rate=1e30", "optimizer.warmup_steps=0", "run.max_nonfinite=2")
    result = run(tmp_path, cache_dir, overrides, expect=3)
    assert "error: stopped: 2 steps in a row (up to step" in result.stderr
    assert "had a non-finite loss or gradient and were skipped" in result.stderr
    skipped = [r["skipped"] for r in records(tmp_path) if "loss" in r]
    assert skipped[-2:] == [1, 1]


def test_dry_run_plans_without_training(tmp_path: Path, cache_dir: Path):
    result = run(tmp_path / "dry", cache_dir, extra=("--dry-run",))
    assert "total" in result.stdout and "active per token" in result.stdout
    assert "per-device memory of the compiled step" in result.stdout
    assert re.search(
        r"memory: host RAM: needs [0-9.]+ .iB \(8 devices x [0-9.]+ .iB \+ host buffers "
        r"[0-9.]+ .iB\), [0-9.]+ .iB available: fits",
        result.stdout,
    ), result.stdout
    assert "blocks.layers.attention.wq" in result.stdout
    assert not (tmp_path / "dry" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "mesh.dp=two"], "error: mesh.dp: expected int, got 'two'"),
        (["--set", "model.bogus=1"], "error: model.bogus: unknown key"),
        (["--set", "nothing"], "error: --set 'nothing': expected section.key=value"),
    ],
)
def test_config_errors_exit_2_with_one_line(args, message, capsys):
    assert main([TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert len(err.strip().splitlines()) == 1


def test_missing_config_file(capsys, tmp_path: Path):
    assert main([str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in capsys.readouterr().err


def test_generate_samples_from_the_latest_checkpoint(reference_dir: Path):
    command = [sys.executable, "-m", "pipelines.generate", str(reference_dir)]
    options = ["--prompt", "def main(", "--max-new-tokens", "8", "--temperature", "0"]
    results = [run_command(command + options) for _ in range(2)]
    assert results[0].stdout.startswith("(step 6) def main(")
    assert (reference_dir / "tokenizer.json").is_file(), "the run keeps its tokenizer"
    assert results[0].stdout == results[1].stdout, "greedy decoding is deterministic"


def test_generate_chat_needs_the_checkpoints_chat_template(reference_dir: Path):
    """``--chat`` renders the prompt with the template of the checkpoint a run started from;
    a run from scratch has none to use."""
    command = [sys.executable, "-m", "pipelines.generate", str(reference_dir), "--chat"]
    result = run_command([*command, "--prompt", "hello"], expect=2)
    assert result.stderr == (
        f"error: --chat: {reference_dir} keeps no chat template (a run from a Hugging Face "
        "checkpoint keeps its tokenizer_config.json in RUN_DIR/hf_source/, and this run's has "
        "no chat_template): give the prompt as plain text, without --chat\n"
    )


def test_generate_needs_a_run_directory(tmp_path: Path):
    result = run_command(
        [sys.executable, "-m", "pipelines.generate", str(tmp_path), "--prompt", "x"], expect=2
    )
    assert result.stderr == f"error: {tmp_path} has no config.toml: not a pipelines.run directory\n"


def test_run_dir_that_is_a_file_is_one_line(tmp_path: Path, cache_dir: Path):
    run_dir = tmp_path / "not-a-directory"
    run_dir.write_text("someone's notes\n")
    result = run(run_dir, cache_dir, expect=2)
    assert result.stderr == f"error: --run-dir {run_dir}: exists and is not a directory\n"
    assert run_dir.read_text() == "someone's notes\n"
