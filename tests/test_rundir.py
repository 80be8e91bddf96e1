"""Run directories (one run at a time, resumed only by the same run) and the memory check
of a plan, in process; `tests/test_run_safety.py` shows them through `pipelines.run`."""

import dataclasses
import fnmatch
import json
import os
import re
from pathlib import Path

import pytest

from eqxzoo.run.config import (
    RESUMABLE_KEYS,
    SWITCHED_OFF_BY_ZERO,
    RunConfig,
    config_to_dict,
    document_key,
    load_config,
)
from eqxzoo.run.rundir import (
    NotTheSameRun,
    RunDirBusy,
    RunDirLock,
    changed_keys,
    check_same_run,
    is_resumable,
    prepare_run_dir,
    refused_changes,
    write_run_config,
)
from eqxzoo.train.checkpoint import STEP_METADATA_FILE
from eqxzoo.train.memory import (
    GIB,
    MemoryCheck,
    PlanDoesNotFit,
    StepMemory,
    check_fits,
    host_memory_available,
)
from eqxzoo.typed_config import config_leaves, field_role, flatten
from models.config import RUNTIME_KEYS, DecoderConfig
from models.registry import families
from pipelines.run import main as run_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def finished_checkpoint(run_dir: Path, step: int, config: RunConfig) -> None:
    """A directory as a finished save of ``config``'s run leaves it (enough for the run
    directory's checks: the step's metadata file and its meta item holding the config)."""
    (run_dir / "checkpoints" / str(step) / "meta").mkdir(parents=True)
    (run_dir / "checkpoints" / str(step) / STEP_METADATA_FILE).write_text("{}")
    meta = {"config": config_to_dict(config)}
    (run_dir / "checkpoints" / str(step) / "meta" / "metadata").write_text(json.dumps(meta))


def test_a_second_lock_names_the_holder_and_a_released_lock_is_free(tmp_path: Path):
    first = RunDirLock(tmp_path)
    first.acquire()
    with pytest.raises(RunDirBusy) as refused:
        RunDirLock(tmp_path).acquire()
    assert re.fullmatch(
        rf"--run-dir {tmp_path} is in use by another run \(pid {os.getpid()} on \S+, started "
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d\); wait for it to end or stop it, or give "
        r"this run another --run-dir",
        str(refused.value),
    ), str(refused.value)
    first.release()
    second = RunDirLock(tmp_path)
    second.acquire()
    second.release()


def test_a_refused_resume_keeps_the_saved_config_and_releases_its_lock(
    tmp_path: Path,
):
    config = load_config(TINY)
    prepare_run_dir(tmp_path, config, lock=True).release()
    assert not (tmp_path / "config.toml").exists(), "written once the run's state is open"
    write_run_config(tmp_path, config)
    finished_checkpoint(tmp_path, 4, config)
    saved = (tmp_path / "config.toml").read_text()
    other = load_config(TINY, ["model.d_model=128"])
    with pytest.raises(NotTheSameRun):
        prepare_run_dir(tmp_path, other, lock=True)
    assert (tmp_path / "config.toml").read_text() == saved
    prepare_run_dir(tmp_path, config, lock=True).release()  # the refusal released its lock


def test_another_architecture_or_data_order_is_refused_naming_every_key(tmp_path: Path):
    finished_checkpoint(tmp_path, 100, load_config(TINY))
    changed = load_config(TINY, ["model.d_model=128", "data.seed=7", "run.steps=400"])
    with pytest.raises(NotTheSameRun) as refused:
        check_same_run(tmp_path, changed)
    assert str(refused.value) == (
        f"--run-dir {tmp_path} holds another run (its checkpoint of step 100): data.seed = 0 "
        "in the run, 7 now; model.d_model = 96 in the run, 128 now. Resume it with its own "
        f"config ({tmp_path / 'config.toml'}; if that was edited or lost, rewrite it with "
        f"python -m pipelines.run --run-dir {tmp_path} --repair-config), or start this one in "
        "a new --run-dir"
    )


def test_without_checkpoints_any_config_may_start_over(tmp_path: Path):
    prepare_run_dir(tmp_path, load_config(TINY), lock=False)
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp").mkdir(parents=True)
    check_same_run(tmp_path, load_config(TINY, ["model.d_model=128"]))


def documented_resumable() -> set[str]:
    """The keys README's "Run directories" says a resume may change (``mesh.*`` patterns)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Run directories", 1)[1].split("\n### ", 1)[0]
    allowed = section.split("What may change between a run and its resume:", 1)[1]
    allowed = allowed.split("\n\n", 2)[1]  # the list: the paragraph after the colon
    return set(re.findall(r"`([a-z_]+(?:\.[a-z0-9_*]+)+)`", allowed))


@pytest.mark.parametrize(
    "key",
    sorted(
        set(flatten(config_to_dict(RunConfig()))) | set(flatten(config_to_dict(load_config(TINY))))
    ),
)
def test_each_key_may_change_on_resume_exactly_when_readme_lists_it(key: str):
    """Every key of a config (the default one's and a MoE one's), changed alone: refused
    unless README's list names it."""
    saved = config_to_dict(load_config(TINY))
    new = config_to_dict(load_config(TINY))
    *sections, name = key.split(".")
    table = new
    for section in sections:
        table = table.setdefault(section, {})
    table[name] = "changed"
    assert [change.key for change in changed_keys(saved, new)] == [key]
    documented = any(fnmatch.fnmatchcase(key, pattern) for pattern in documented_resumable())
    assert (refused_changes(saved, new) == []) == documented


def test_what_defines_the_run_is_never_resumable():
    for key in (
        "model.d_model",
        "model.family",
        "model.moe.n_experts",
        "model.vocab_size",
        "data.path",
        "data.seed",
        "data.seq_len",
        "data.vocab_size",
        "run.seed",
        "optimizer.name",
        "optimizer.freeze",
        "precision.params",
    ):
        assert not is_resumable(key), key


def test_readme_lists_exactly_the_resumable_keys():
    """README's patterns name exactly the `runtime_field`s: each pattern some, and no other
    leaf of the config."""
    patterns = documented_resumable()
    every_key = [document_key(key) for key in config_leaves(RunConfig)]
    for pattern in patterns:
        assert any(fnmatch.fnmatchcase(key, pattern) for key in RESUMABLE_KEYS), pattern
    for key in every_key:
        documented = any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)
        assert documented == (key in RESUMABLE_KEYS), key


def test_how_the_model_runs_may_change_on_resume():
    for key in ("model.remat", "model.attention_kernel", "model.moe.routing", "mesh.dp"):
        assert is_resumable(key), key
    assert is_resumable("model.init_from_hf")
    assert set(SWITCHED_OFF_BY_ZERO) == {"optimizer.clip_norm", "optimizer.weight_decay"}


def test_every_config_field_declares_its_role():
    """Every leaf of every section, and of every family's model config, says once whether it
    is architecture, identity or runtime; a family subclass that only changes a default keeps
    its base's role, and a field a family adds (DeepSeek-V3's ``rope_interleave``) declares
    its own."""
    undeclared = [
        key
        for key, (cls, name) in config_leaves(RunConfig).items()
        if field_role(cls, name) is None
    ]
    assert undeclared == []
    base = set(config_leaves(DecoderConfig))
    for family in families().values():
        config_class = family.config_class
        leaves = config_leaves(config_class)
        assert set(leaves) >= base, config_class
        assert all(field_role(cls, name) for cls, name in leaves.values()), config_class
    assert RUNTIME_KEYS == (
        "moe.routing",
        "moe.capacity_factor",
        "moe.dropless_kernel",
        "scan_layers",
        "remat",
        "attention_kernel",
        "attention_block_size",
        "context_parallel",
        "context_axis",
        "expert_axis",
    )


def test_a_plan_that_does_not_fit_says_what_it_needs_and_what_to_change():
    step = StepMemory(arguments=GIB, outputs=GIB, donated=GIB, temporaries=40 * GIB)
    checks = [MemoryCheck("host RAM", 8 * step.total + GIB, 20 * GIB, "8 devices x 41.0 GiB")]
    with pytest.raises(PlanDoesNotFit) as refused:
        check_fits(checks, step, remat_stages=False)
    assert str(refused.value) == (
        "this plan does not fit: host RAM: needs 329.0 GiB (8 devices x 41.0 GiB), 20.0 GiB "
        "available: does not fit; per device the step takes 41.0 GiB = arguments 1.0 GiB + "
        "outputs 1.0 GiB - donated 1.0 GiB + temporaries 40.0 GiB; activations dominate: lower "
        "data.batch_size, data.seq_len or pipeline.microbatches, or set "
        "pipeline.remat_stages = true (python -m pipelines.run CONFIG --dry-run shows the plan)"
    )
    state_bound = dataclasses.replace(step, arguments=50 * GIB, temporaries=GIB)
    with pytest.raises(PlanDoesNotFit, match="the parameters and optimizer state dominate"):
        check_fits(checks, state_bound, remat_stages=True)
    check_fits([MemoryCheck("host RAM", GIB, 2 * GIB, "")], step, remat_stages=True)


def test_host_memory_available_is_plausible():
    available = host_memory_available()
    total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    assert 0 < available <= total


@pytest.mark.parametrize("key", ["optimizer.clip_norm", "optimizer.weight_decay"])
def test_turning_clipping_or_weight_decay_on_or_off_is_refused(key: str):
    """0 removes the transformation and its optimizer state: the checkpoint would not restore."""
    section, name = key.split(".")
    saved = config_to_dict(load_config(TINY, [f"{key}=0.5"]))
    for value, refused in ((0.25, False), (0.0, True)):
        new = config_to_dict(load_config(TINY, [f"{key}={value}"]))
        assert [change.key for change in refused_changes(saved, new)] == ([key] if refused else [])
    off = config_to_dict(load_config(TINY, [f"{key}=0"]))
    assert [change.key for change in refused_changes(off, saved)] == [key]


def test_repair_config_rewrites_config_toml_from_the_newest_checkpoint(tmp_path: Path, capsys):
    """``pipelines.run --run-dir RUN --repair-config``: config.toml edited or lost is rewritten
    from the config the newest checkpoint holds; without a checkpoint, or with a config
    argument, it is refused in one line."""
    assert run_main(["--run-dir", str(tmp_path), "--repair-config"]) == 2
    assert capsys.readouterr().err == (
        f"error: --run-dir {tmp_path}: no checkpoint holds a config to repair from\n"
    )
    config = load_config(TINY, ["model.d_model=64"])
    finished_checkpoint(tmp_path, 2, load_config(TINY))
    finished_checkpoint(tmp_path, 3, config)
    (tmp_path / "config.toml").write_text("edited by hand")
    assert run_main(["--run-dir", str(tmp_path), "--repair-config"]) == 0
    assert capsys.readouterr().out == (
        f"wrote {tmp_path / 'config.toml'} from the config of the checkpoint of step 3\n"
    )
    assert load_config(tmp_path / "config.toml") == config
    for argv in (["--repair-config"], [str(TINY), "--run-dir", str(tmp_path), "--repair-config"]):
        with pytest.raises(SystemExit) as refused:
            run_main(argv)
        assert refused.value.code == 2
        assert capsys.readouterr().err.endswith(
            "error: --repair-config takes --run-dir RUN_DIR and no config\n"
        )
    with pytest.raises(SystemExit):
        run_main([])
    assert capsys.readouterr().err.endswith(
        "error: a config is needed (or --repair-config with --run-dir)\n"
    )
