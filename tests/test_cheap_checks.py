"""Checks made where they are cheap, each ending in one line: cuDNN attention against the
compute dtype (config) and the platform (run start, dry run); non-finite Hugging Face weights
at load, naming the tensor; a stop signal before the first step (exit 0, nothing saved); a
run already at its last step; a checkpoint whose arrays are not the config's model, in the
project's words."""

import dataclasses
import functools
import signal
import time
from pathlib import Path

import equinox as eqx
import grain
import jax
import numpy as np
import pytest
from runs import TINY, command, environment, spawn
from test_rundir import finished_checkpoint

import models
from eqxzoo.errors import UserError
from eqxzoo.nn.kernels import cudnn_runs
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.run.config import (
    ConfigError,
    RunConfig,
    check_kernel_platform,
    config_from_dict,
    load_config,
)
from eqxzoo.run.loop import RunOptions, _Trainer, train
from eqxzoo.run.rundir import NotTheSameRun
from eqxzoo.train import state as train_state
from eqxzoo.train import stop_signal
from eqxzoo.train.checkpoint import (
    Checkpointer,
    CheckpointMismatch,
    finished_steps,
)
from eqxzoo.train.layout import abstract_checkpoint_state, checkpoint_layout
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import init_train_state, train_state_axes
from eqxzoo.train.stop_signal import StoppedBeforeFirstStep
from models.hf import save_hf
from models.tensor_files import WEIGHTS_NAME, NonFiniteTensor, SafetensorsFiles
from pipelines import run as pipelines_run

CUDNN = "model.attention_kernel=cudnn"
HALF = "precision.compute=bfloat16"


@pytest.fixture
def no_runtime_setup(monkeypatch):
    """`pipelines.run.main` in this process: its runtime setup (compilation cache, device
    count) would reconfigure the suite's JAX, which already has its 8 CPU devices."""
    monkeypatch.setattr("eqxzoo.runtime.setup_runtime", lambda **settings: None)


# --------------------------------------------------------------------------- cuDNN attention


def test_cudnn_runs_knows_the_dtype_and_the_platform():
    assert cudnn_runs(dtype="bfloat16", platform="gpu") is True
    assert cudnn_runs(dtype="float16") is True
    assert cudnn_runs(dtype="float32") == "takes bfloat16 or float16, not float32"
    assert cudnn_runs(platform="cpu") == "runs only on an NVIDIA GPU, not on cpu"


def test_cudnn_with_float32_compute_is_refused_by_the_config_and_the_dry_run(capsys):
    message = (
        "model.attention_kernel: 'cudnn' cannot run with precision.compute = 'float32': "
        "cuDNN's fused attention takes bfloat16 or float16, not float32, on an NVIDIA GPU; use "
        "'auto', 'blockwise' or 'dense', or set precision.compute = 'bfloat16'"
    )
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, [CUDNN])
    assert str(refused.value) == message
    assert pipelines_run.main([TINY, "--set", CUDNN, "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert load_config(TINY, [CUDNN, HALF]).model.attention_kernel == "cudnn"


CUDNN_ON_CPU = (
    "model.attention_kernel: 'cudnn' cannot run here: cuDNN's fused attention runs only on an "
    "NVIDIA GPU, not on cpu (with bfloat16 or float16 compute); use 'auto', 'blockwise' or "
    "'dense'"
)


def test_cudnn_on_cpu_devices_is_refused_before_anything_compiles(
    tmp_path: Path, capsys, no_runtime_setup
):
    """The dtype is right, the platform is not: the dry run and the run (before it locks or
    creates its directory) refuse in one line."""
    config = load_config(TINY, [CUDNN, HALF])
    check_kernel_platform(config, "gpu")
    with pytest.raises(ConfigError) as refused:
        check_kernel_platform(config, "cpu")
    assert str(refused.value) == CUDNN_ON_CPU
    run_dir = tmp_path / "run"
    for extra in (["--dry-run"], ["--run-dir", str(run_dir)]):
        assert pipelines_run.main([TINY, "--set", CUDNN, "--set", HALF, *extra]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"error: {CUDNN_ON_CPU}\n"
        assert captured.out == ""
    assert not run_dir.exists()


# --------------------------------------------------------------------- non-finite HF weights

LLAMA = models.LlamaConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=2, mlp_dim=32)
POISONED = "model.layers.2.mlp.up_proj.weight"


def save_llama(directory: Path, *, poison: bool) -> Path:
    """A tiny Llama as a Hugging Face checkpoint; with ``poison``, one NaN in layer 2's up
    projection (HF ``POISONED``)."""
    model = models.DecoderLM(LLAMA, key=jax.random.key(0))
    if poison:
        model = eqx.tree_at(
            lambda m: m.blocks.layers.mlp.up.weight,
            model,
            model.blocks.layers.mlp.up.weight.at[2, 3, 5].set(np.nan),
        )
    save_hf(model, directory)
    return directory


def hf_config(hf_dir: Path, tmp_path: Path) -> RunConfig:
    return config_from_dict(
        {
            "model": {"init_from_hf": str(hf_dir)},
            "mesh": {"dp": 2, "pp": 2, "tp": 2},
            "pipeline": {"schedule": "circular", "microbatches": 2, "repeats": 2},
            "data": {"path": str(tmp_path / "no-data"), "batch_size": 2, "seq_len": 8},
        }
    )


def fresh_state_of(config: RunConfig, run_dir: Path):
    """What a fresh run's `open_state` initialises (`_Trainer.fresh_state`): the weights of
    ``init_from_hf`` read by slices into the sharded state."""
    trainer = _Trainer(config, RunOptions(run_dir=run_dir), say=lambda text: None)
    trainer.hf_checkpoint = None
    return trainer.fresh_state()


def test_a_non_finite_weight_is_refused_at_load_naming_its_tensor(tmp_path: Path):
    hf_dir = save_llama(tmp_path / "hf", poison=True)
    stored = SafetensorsFiles(hf_dir).tensor(POISONED)[()]
    position = tuple(int(i) for i in np.argwhere(np.isnan(stored))[0])
    with pytest.raises(NonFiniteTensor) as refused:
        fresh_state_of(hf_config(hf_dir, tmp_path), tmp_path / "run")
    assert isinstance(refused.value, UserError)
    assert str(refused.value) == (
        f"tensor {POISONED} of {hf_dir / WEIGHTS_NAME} holds nan at {position}: the "
        "checkpoint's weights are damaged (or saved from a diverged model); replace the file "
        "or convert the weights again"
    )


def test_finite_weights_load_and_a_refusal_elsewhere_stops_every_process(
    tmp_path: Path, monkeypatch
):
    """Clean weights load, each read once; when another process refuses what it read, this
    one, which read clean slices, raises too instead of going on alone."""
    hf_dir = save_llama(tmp_path / "hf", poison=False)
    config = hf_config(hf_dir, tmp_path)
    state = fresh_state_of(config, tmp_path / "run")
    assert int(state.step) == 0
    monkeypatch.setattr(train_state, "on_every_process", lambda ok: False)
    with pytest.raises(UserError) as refused:
        fresh_state_of(config, tmp_path / "run")
    assert str(refused.value) == (
        "another process refused the weights it read (its error line says why)"
    )


def test_only_what_is_read_is_checked_and_positions_are_the_stored_tensors(tmp_path: Path):
    import ml_dtypes
    import safetensors.numpy

    values = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    values[1, 2] = np.inf
    safetensors.numpy.save_file({"w": values}, str(tmp_path / WEIGHTS_NAME))
    files = SafetensorsFiles(tmp_path)
    assert np.isinf(files.tensor("w")[()]).any(), "off by default: a reader sees what is stored"
    files.refuse_non_finite = True
    np.testing.assert_array_equal(files.tensor("w").T[:2], values.T[:2])
    with pytest.raises(NonFiniteTensor, match=rf"^tensor w of {tmp_path / WEIGHTS_NAME} holds "):
        files.tensor("w").T[2:, 1:]
    with pytest.raises(NonFiniteTensor, match=r" holds inf at \(1, 2\): "):
        files.tensor("w").strided(1, 0, 2)[1:]


# ------------------------------------------------------------ signals before the first step


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_compiling_stops_at_once_with_nothing_to_save(
    tmp_path: Path, cache_dir: Path, signum: int
):
    """Sent once JAX logs that it compiles the train step (``jit(step)``, before anything is
    initialised): exit 0, one line, no checkpoint, no metrics, no config written."""
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    process = spawn(command(run_dir, cache_dir), log, env=environment() | {"JAX_LOG_COMPILES": "1"})
    try:
        deadline = time.monotonic() + 300
        while "Compiling jit(step) " not in log.read_text():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        process.send_signal(signum)
        code = process.wait(timeout=300)
    finally:
        process.kill()
    output = log.read_text()
    assert code == 0, output[-3000:]
    lines = output.splitlines()
    assert lines.count(StoppedBeforeFirstStep.MESSAGE) == 1, output[-3000:]
    assert lines[-1] == StoppedBeforeFirstStep.MESSAGE, output[-3000:]
    assert "Traceback" not in output and "error:" not in output, output[-3000:]
    assert "first step done" not in output
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or finished_steps(checkpoints) == []
    assert not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "config.toml").exists()


def test_a_signal_before_the_run_starts_is_the_same_line(capsys, monkeypatch):
    """`pipelines.run.main` answers the stop wherever it is raised (here: while loading the
    config), and puts the handlers it found back."""
    before = signal.getsignal(signal.SIGINT)

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr("eqxzoo.run.config.load_config", interrupted)
    assert pipelines_run.main([TINY]) == 0
    assert capsys.readouterr().out == StoppedBeforeFirstStep.MESSAGE + "\n"
    assert signal.getsignal(signal.SIGINT) is before


class _SignalledWhileFinalised:
    def __del__(self):
        signal.raise_signal(signal.SIGTERM)
        sum(range(10))  # the handler runs here: the stop is dropped with the finaliser


def test_a_stop_dropped_by_a_finaliser_is_raised_before_the_run_goes_on(capsys):
    """The handler's exception lands where the main thread is; a finaliser (or a callback
    from C++) drops it. It is raised again, quietly, before the first step."""
    with pytest.raises(StoppedBeforeFirstStep) as stopped:
        with stop_signal.stopping_before_first_step():
            _SignalledWhileFinalised()
            assert signal.getsignal(signal.SIGTERM) is stop_signal._stop_now
            with stop_signal.StopSignal():
                pass
    assert stopped.value.signum == signal.SIGTERM
    assert "Exception ignored" not in capsys.readouterr().err
    with stop_signal.StopSignal() as stop:  # the next run starts afresh
        assert not stop.received


def test_with_the_preemption_service_ctrl_c_is_passed_on_as_sigterm(monkeypatch):
    """Joined processes stop together through JAX's preemption service (which owns SIGTERM:
    here Python's handler stands in for it): one leaving alone would take the others down."""
    monkeypatch.setattr(stop_signal, "_preemption_service", lambda: True)
    with pytest.raises(StoppedBeforeFirstStep) as stopped:
        with stop_signal.stopping_before_first_step():
            signal.raise_signal(signal.SIGINT)
    assert stopped.value.signum == signal.SIGTERM


# ----------------------------------------------------------------------- nothing left to do


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (["--steps", "100"], "the run is at step 150; --steps 100 leaves nothing to do"),
        (["--steps", "150"], "the run is at step 150; --steps 150 leaves nothing to do"),
        (
            ["--set", "run.steps=150"],
            "the run is at step 150; run.steps = 150 leaves nothing to do",
        ),
        (
            ["--set", "run.steps=120", "--steps", "200"],
            "the run is at step 150; run.steps = 120 leaves nothing to do",
        ),
    ],
)
def test_a_run_at_its_last_step_says_there_is_nothing_to_do(
    tmp_path: Path, capsys, no_runtime_setup, arguments, line
):
    """Known from the newest checkpoint before anything is compiled, read or written."""
    run_dir = tmp_path / "run"
    finished_checkpoint(run_dir, 150, load_config(TINY))
    before = sorted(path.relative_to(run_dir) for path in run_dir.rglob("*"))
    assert pipelines_run.main([TINY, "--run-dir", str(run_dir), *arguments]) == 0
    captured = capsys.readouterr()
    assert captured.out == line + "\n"
    assert captured.err == ""
    after = sorted(path.relative_to(run_dir) for path in run_dir.rglob("*"))
    assert after == sorted([*before, Path("run.lock")]), "only the lock was touched"


def test_steps_0_on_a_fresh_run_has_nothing_to_do(tmp_path: Path):
    lines = []
    summary = train(
        load_config(TINY), RunOptions(run_dir=tmp_path / "run", stop_after=0), say=lines.append
    )
    assert lines == ["the run is at step 0; --steps 0 leaves nothing to do"]
    assert not summary.trained


# --------------------------------------------------------------- checkpoint against config

MODEL = functools.partial(models.DecoderLM, LLAMA)
STEP_CONFIG = StepConfig(schedule=Schedule("gpipe", 2, 2, 1))


def test_a_shape_change_on_resume_is_refused_by_the_config_check_first(tmp_path: Path):
    """Through `pipelines.run`, a config that changes an architecture key is refused by
    the run directory's check, naming the key, before any restore compares shapes."""
    run_dir = tmp_path / "run"
    finished_checkpoint(run_dir, 4, load_config(TINY))
    with pytest.raises(NotTheSameRun, match=r": model\.d_model = 96 in the run, 128 now\. "):
        train(load_config(TINY, ["model.d_model=128"]), RunOptions(run_dir=run_dir))


def save_a_checkpoint(directory: Path) -> None:
    """A checkpoint of step 3 of a `MODEL` train state on pp=2, as the run saves it."""
    mesh = make_mesh(MeshConfig(pp=2), jax.devices()[:2])
    state = init_train_state(MODEL, jax.random.key(0), config=STEP_CONFIG, mesh=mesh)
    plain = checkpoint_layout(
        state, train_state_axes(MODEL, config=STEP_CONFIG), STEP_CONFIG.rules, STEP_CONFIG.schedule
    )
    iterator = grain.MapDataset.range(10).to_iter_dataset().__iter__()
    with Checkpointer(directory, every=1, keep=1, async_save=False) as checkpointer:
        checkpointer.save(3, plain, iterator, {"step": 3})


@pytest.mark.parametrize(
    ("changes", "difference"),
    [
        (
            dict(mlp_dim=48),
            "it holds model.blocks.layers.mlp.gate.weight with shape (4, 16, 32), where the "
            "state to restore has (4, 16, 48) (and 8 more)",
        ),
        (
            dict(qkv_bias=True),
            "it has no model.blocks.layers.attention.bq, which the state to restore has (shape "
            "(4, 2, 8)) (and 8 more)",
        ),
    ],
    ids=["shape", "arrays"],
)
def test_a_checkpoint_of_another_model_is_refused_naming_an_array_and_both_shapes(
    tmp_path: Path, changes, difference
):
    """Where the config check cannot see it (a checkpoint restored with a model the code
    now builds otherwise, or through the API), the restore says which array differs, in the
    project's words, and moves nothing aside."""
    save_a_checkpoint(tmp_path)
    other = functools.partial(models.DecoderLM, dataclasses.replace(LLAMA, **changes))
    mesh = make_mesh(MeshConfig(pp=2), jax.devices()[:2])
    target = abstract_checkpoint_state(other, config=STEP_CONFIG, mesh=mesh)
    with Checkpointer(tmp_path, every=1, keep=1, async_save=False) as checkpointer:
        with pytest.raises(CheckpointMismatch) as refused:
            checkpointer.restore_latest(target, None)
    assert str(refused.value) == (
        f"the checkpoint of step 3 does not fit this run's model: {difference}. The config (or "
        "the code) builds another model than the one saved: use the run's own config or start "
        "a new --run-dir; nothing was moved or deleted"
    )
    assert finished_steps(tmp_path) == [3]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["3"]


def test_an_error_raised_while_a_stop_unwinds_is_still_the_stop(monkeypatch, capsys):
    """A signal that lands inside JAX's tracing can break the cleanup around it (seen once:
    ``AttributeError: 'int' object has no attribute '_get_vars'`` with the stop as its
    context): the run still ends with the stop's one line and exit code 0."""
    import pipelines.run

    def broken_by_a_stop(args):
        try:
            raise StoppedBeforeFirstStep(signal.SIGTERM)
        except StoppedBeforeFirstStep:
            raise AttributeError("'int' object has no attribute '_get_vars'")  # noqa: B904

    monkeypatch.setattr(pipelines.run, "run", broken_by_a_stop)
    assert pipelines.run.main([str(TINY)]) == 0
    assert capsys.readouterr().out.splitlines() == [StoppedBeforeFirstStep.MESSAGE]

    def broken(args):
        raise AttributeError("not a stop")

    monkeypatch.setattr(pipelines.run, "run", broken)
    with pytest.raises(AttributeError, match="not a stop"):
        pipelines.run.main([str(TINY)])
