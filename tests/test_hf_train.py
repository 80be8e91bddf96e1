"""The road in and out of the trainer: a Hugging Face checkpoint loaded straight into the
sharded, staged train state (`init_train_state_from` over `models.hf.open_hf`), saved as a
run's checkpoint, and exported back (`pipelines.export`) bit for bit; ``[model]
init_from_hf`` in run configs; and every error of both roads, by its message.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import grain  # noqa: E402
import jax  # noqa: E402
import safetensors.numpy  # noqa: E402
from damaging import truncate_array_files  # noqa: E402
from hf_models import HF_CASES, hf_config, randomize  # noqa: E402

from eqxzoo.data.manifest import TOKENIZER_FILE  # noqa: E402
from eqxzoo.data.tokenizer import train_byte_level_bpe  # noqa: E402
from eqxzoo.parallel import MeshConfig, make_mesh  # noqa: E402
from eqxzoo.run.config import (  # noqa: E402
    ConfigError,
    DataConfig,
    PipelineConfig,
    RunConfig,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    step_config,
)
from eqxzoo.run.provenance import HF_SOURCE_DIR, HF_SOURCE_FILES, keep_run_sources  # noqa: E402
from eqxzoo.run.rundir import CHECKPOINT_DIR, CONFIG_FILE, read_run_config  # noqa: E402
from eqxzoo.train.checkpoint import Checkpointer  # noqa: E402
from eqxzoo.train.layout import checkpoint_layout, from_pipeline_layout  # noqa: E402
from eqxzoo.train.state import init_train_state_from, train_state_axes  # noqa: E402
from models import load_hf, model_factory  # noqa: E402
from models.hf import open_hf  # noqa: E402
from models.registry import hf_architectures  # noqa: E402
from pipelines import export  # noqa: E402

# One case per family with a Hugging Face architecture.
FAMILY_CASES = (
    "llama_attention_bias",
    "mixtral_top2_of_4",
    "qwen_moe_gqa",
    "mistral_window",
    "qwen3_sliding_bias",
    "qwen3_moe_window_bias",
    "gemma2_softcapped",
    "gemma3_local_global",
    "olmo2_bias_tied",
    "olmoe_clip",
    "gpt2_untied",
    "deepseek_v3_q_lora",
    "deepseek_v2_lite",
    "gpt_oss_sliding_sinks",
)
MESH = MeshConfig(dp=2, pp=2, tp=2)
CIRCULAR = PipelineConfig(schedule="circular", microbatches=2, repeats=2)


def save_hf_model(case: str, directory: Path, n_layers: int = 4) -> Path:
    """A randomised transformers model of ``case`` with ``n_layers`` layers saved to
    ``directory`` by ``save_pretrained``."""
    architecture, fields, _ = HF_CASES[case]
    torch.manual_seed(0)
    config = hf_config(architecture, n_layers=n_layers, **fields)
    model = randomize(getattr(transformers, architecture)(config))
    model.save_pretrained(directory)
    return directory


def hf_run_config(hf_dir: Path, tmp_path: Path, **sections) -> RunConfig:
    """A run config that starts from ``hf_dir`` on a dp2 x pp2 x tp2 circular mesh."""
    document = {
        "model": {"init_from_hf": str(hf_dir)},
        "mesh": {"dp": 2, "pp": 2, "tp": 2},
        "pipeline": {"schedule": "circular", "microbatches": 2, "repeats": 2},
        "data": {"path": str(tmp_path / "no-data"), "batch_size": 2, "seq_len": 8},
        **sections,
    }
    return config_from_dict(document)


def data_iterator():
    """A grain iterator for the checkpoint to save the state of."""
    return grain.MapDataset.range(10).to_iter_dataset().__iter__()


def stored_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(safetensors.numpy.load_file(str(file)))
    return tensors


def test_every_family_has_a_round_trip_case():
    assert {HF_CASES[case][0] for case in FAMILY_CASES} == set(hf_architectures())


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_hf_to_sharded_state_to_export_is_bitwise(case: str, tmp_path: Path):
    """Hugging Face -> train state (dp2 x pp2 x tp2, circular) -> checkpoint ->
    ``pipelines.export`` gives back every tensor bit for bit."""
    prefix_layers = HF_CASES[case][1].get("first_k_dense_replace", 0)
    hf_dir = save_hf_model(case, tmp_path / "hf", n_layers=4 + prefix_layers)
    config = hf_run_config(hf_dir, tmp_path)
    checkpoint = open_hf(hf_dir)
    make_model = model_factory(config.model)
    mesh = make_mesh(config.mesh)
    settings = step_config(config)
    state = init_train_state_from(make_model, checkpoint.model, config=settings, mesh=mesh)
    wo = state.model.blocks.layers.attention.wo
    assert wo.shape[:3] == (2, 2, 1) and wo.sharding.spec[1] == "pp"
    assert wo.addressable_shards[0].data.size < wo.size  # never whole on one device
    if prefix_layers:  # outside the pipeline: not staged, sharded by the same rules
        prefix_wo = state.model.prefix.layers.attention.wo
        assert prefix_wo.shape[0] == prefix_layers
        assert prefix_wo.addressable_shards[0].data.size < prefix_wo.size
    assert checkpoint.files.bytes_read <= checkpoint.files.total_bytes

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / CONFIG_FILE).write_text(config_to_toml(config))
    keep_run_sources(run_dir, config, tokenized_data(hf_dir, tmp_path / "data"), fresh=True)
    saved = checkpoint_layout(
        state, train_state_axes(make_model, config=settings), settings.rules, settings.schedule
    )
    with Checkpointer(run_dir / CHECKPOINT_DIR, every=1, keep=1, async_save=False) as saver:
        saver.save(3, saved, data_iterator(), {})
    original = stored_tensors(hf_dir)
    shutil.rmtree(hf_dir)  # the run's config names it; exporting must not need it

    assert export.main([str(run_dir), "--out", str(tmp_path / "out")]) == 0
    exported = stored_tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
    exported_config = json.loads((tmp_path / "out" / "config.json").read_text())
    source_config = json.loads((run_dir / HF_SOURCE_DIR / "config.json").read_text())
    assert exported_config == source_config, "the source's own config.json, every field"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == HF_CASES[case][0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.decode(tokenizer("def main()")["input_ids"]) == "def main()"


def test_loading_reads_only_the_slices_of_this_process(tmp_path: Path):
    """On 8 devices of one process everything is read once; the state equals `load_hf`."""
    hf_dir = save_hf_model("llama_gqa", tmp_path / "hf")
    config = hf_run_config(hf_dir, tmp_path)
    checkpoint = open_hf(hf_dir)
    settings = step_config(config)
    state = init_train_state_from(
        model_factory(config.model),
        checkpoint.model,
        config=settings,
        mesh=make_mesh(config.mesh),
    )
    assert checkpoint.files.bytes_read == checkpoint.files.total_bytes
    loaded = from_pipeline_layout(state.model, settings.schedule)
    expected = load_hf(hf_dir)
    for actual, wanted in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(wanted))


def test_parameters_take_the_runs_dtype_and_run_options(tmp_path: Path):
    """The run's dtype and its way of running the model (remat, kernels: static options the
    Hugging Face model lacks) apply to the loaded weights."""
    hf_dir = save_hf_model("llama_gqa", tmp_path / "hf")
    config = hf_run_config(hf_dir, tmp_path, precision={"params": "bfloat16"})
    run_options = dict(remat="full", attention_kernel="blockwise")
    state = init_train_state_from(
        model_factory(dataclasses.replace(config.model, **run_options)),
        open_hf(hf_dir).model,
        config=step_config(config),
        mesh=make_mesh(config.mesh),
    )
    assert {leaf.dtype for leaf in jax.tree.leaves(state.model)} == {np.dtype(jax.numpy.bfloat16)}
    assert int(state.step) == 0
    assert state.model.blocks.remat_policy == "full"


# ------------------------------------------------------------------------------------------
# init_from_hf in run configs
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_hf_model("llama_gqa", tmp_path_factory.mktemp("llama"))


def test_the_architecture_comes_from_config_json(llama_dir: Path, tmp_path: Path):
    config = hf_run_config(llama_dir, tmp_path, model={"init_from_hf": str(llama_dir)})
    assert config.model == open_hf(llama_dir).config
    assert config.init_from_hf == str(llama_dir)
    again = config_from_dict(config_to_dict(config))
    assert again == config


def test_runtime_knobs_may_differ_and_agreeing_keys_are_accepted(llama_dir: Path, tmp_path):
    model = {"init_from_hf": str(llama_dir), "remat": "full", "d_model": 48, "family": "llama"}
    config = hf_run_config(llama_dir, tmp_path, model=model)
    assert config.model.remat == "full" and config.model.d_model == 48


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"d_model": 64}, r"model\.d_model: 64 here but 48 in .*config\.json \(init_from_hf"),
        ({"n_layers": 2}, r"model\.n_layers: 2 here but 4 in"),
        ({"family": "mixtral"}, r"model\.family: 'mixtral' here but .* is family 'llama'"),
        ({"moe": {"n_experts": 4}}, r"model\.moe\.n_experts: 4 here but None in"),
    ],
)
def test_a_key_that_disagrees_with_the_checkpoint_is_refused(
    model: dict, message: str, llama_dir: Path, tmp_path: Path
):
    with pytest.raises(ConfigError, match=message):
        hf_run_config(llama_dir, tmp_path, model={"init_from_hf": str(llama_dir), **model})


def test_a_missing_checkpoint_directory_is_one_line(tmp_path: Path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=rf"model\.init_from_hf: {missing}: no config\.json"):
        hf_run_config(missing, tmp_path)


def test_an_empty_init_from_hf_is_no_init(tmp_path: Path):
    config = config_from_dict({"model": {"init_from_hf": "", "family": "llama"}})
    assert config.init_from_hf == "" and config.model.family == "llama"
    with pytest.raises(ConfigError, match=r"model\.init_from_hf: expected a directory path"):
        config_from_dict({"model": {"init_from_hf": 3}})


def test_a_checkpoint_missing_a_tensor_fails_before_any_training(llama_dir, tmp_path: Path):
    damaged = tmp_path / "damaged"
    shutil.copytree(llama_dir, damaged)
    tensors = safetensors.numpy.load_file(str(damaged / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    safetensors.numpy.save_file(tensors, str(damaged / "model.safetensors"))
    from models.hf import HFCheckpointError

    with pytest.raises(
        HFCheckpointError, match=r"model\.layers\.3\.mlp\.up_proj\.weight is missing"
    ):
        open_hf(damaged)


# ------------------------------------------------------------------------------------------
# pipelines.export's errors
# ------------------------------------------------------------------------------------------


def tokenized_data(hf_dir: Path, data_dir: Path) -> Path:
    """A data directory (of just a tokenizer) tokenized by ``hf_dir``'s tokenizer, or by one
    trained here if it has none."""
    data_dir.mkdir(parents=True)
    if (hf_dir / TOKENIZER_FILE).is_file():
        shutil.copy(hf_dir / TOKENIZER_FILE, data_dir / TOKENIZER_FILE)
    else:
        train_byte_level_bpe(["def main(): return 0\n"], 300).save(str(data_dir / TOKENIZER_FILE))
    return data_dir


def checkpointed_run(hf_dir: Path, tmp_path: Path, steps=(2, 5), **config_sections) -> Path:
    """A run directory as a run from ``hf_dir`` leaves it: checkpoints of ``steps`` of the
    model loaded from ``hf_dir``, and the sources it keeps (`keep_run_sources`) from a data
    directory whose tokenizer is ``hf_dir``'s own (or one trained here if it has none)."""
    data_dir = tokenized_data(hf_dir, tmp_path / "data")
    config = hf_run_config(hf_dir, tmp_path, **config_sections)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, path=str(data_dir)))
    settings = step_config(config)
    make_model = model_factory(config.model)
    state = init_train_state_from(
        make_model, open_hf(hf_dir).model, config=settings, mesh=make_mesh(config.mesh)
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    (run_dir / CONFIG_FILE).write_text(config_to_toml(config))
    keep_run_sources(run_dir, config, data_dir, fresh=True)
    saved = checkpoint_layout(
        state, train_state_axes(make_model, config=settings), settings.rules, settings.schedule
    )
    with Checkpointer(run_dir / CHECKPOINT_DIR, every=1, keep=2, async_save=False) as saver:
        for step in steps:
            saver.save(step, saved, data_iterator(), {})
    return run_dir


@pytest.fixture(scope="module")
def exported_run(tmp_path_factory, llama_dir: Path) -> Path:
    """A run directory holding checkpoints of steps 2 and 5 of a model loaded from Llama."""
    return checkpointed_run(llama_dir, tmp_path_factory.mktemp("run"))


def export_error(capsys, *argv: str) -> str:
    """Run ``pipelines.export ARGV``; it must fail with exit 2 and one ``error:`` line."""
    assert export.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err[len("error: ") :]


def test_export_errors(exported_run: Path, tmp_path: Path, capsys):
    out = str(tmp_path / "out")
    assert export_error(capsys, str(tmp_path / "none"), "--out", out) == (
        f"{tmp_path / 'none'}: no such run directory"
    )
    assert export_error(capsys, str(tmp_path), "--out", out) == (
        f"{tmp_path} has no config.toml: not a pipelines.run directory"
    )
    assert export_error(capsys, "", "--out", out).startswith("RUN_DIR is empty")
    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    shutil.copy(exported_run / CONFIG_FILE, empty_run / CONFIG_FILE)
    assert export_error(capsys, str(empty_run), "--out", out) == (
        f"{empty_run / CHECKPOINT_DIR} holds no checkpoint yet"
    )
    assert export_error(capsys, str(exported_run), "--out", out, "--step", "3") == (
        f"--step 3: {exported_run / CHECKPOINT_DIR} has no such checkpoint; it has 2, 5"
    )
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert export_error(capsys, str(exported_run), "--out", str(occupied)).startswith(
        f"--out {occupied} is not empty; give an empty or new directory, or --force"
    )
    assert export_error(capsys, str(exported_run), "--out", str(occupied / "notes.txt")) == (
        f"--out {occupied / 'notes.txt'} is a file; give a directory"
    )
    assert export_error(capsys, str(exported_run), "--out", out, "--max-shard-size", "0") == (
        "--max-shard-size must be a number of GB > 0, got 0.0"
    )


def test_export_a_step_in_bfloat16_sharded_and_over_an_old_export(
    exported_run: Path, llama_dir: Path, tmp_path: Path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("an older export")
    argv = [str(exported_run), "--out", str(out), "--step", "2", "--dtype", "bfloat16"]
    assert export.main([*argv, "--force", "--max-shard-size", "0.00002"]) == 0
    assert "exported step 2 of" in capsys.readouterr().out
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    original = stored_tensors(llama_dir)
    exported = stored_tensors(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == np.dtype("bfloat16"), name
        np.testing.assert_array_equal(exported[name], tensor.astype("bfloat16"), err_msg=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16


def test_export_refuses_a_damaged_checkpoint(exported_run: Path, tmp_path: Path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(exported_run, run_dir)
    from eqxzoo.train.saved_arrays import saved_arrays

    arrays = saved_arrays(run_dir / CHECKPOINT_DIR / "5")
    meta_dir = run_dir / CHECKPOINT_DIR / "5" / "meta"
    meta_file = next(path for path in meta_dir.iterdir() if path.name != "commit_success.txt")
    meta = json.loads(meta_file.read_text())
    meta["checksums"][".model.final_norm.weight"][0] += 1
    meta_file.write_text(json.dumps(meta))
    assert "model.final_norm.weight" in arrays
    message = export_error(capsys, str(run_dir), "--out", str(tmp_path / "out"))
    assert message == (
        "model.final_norm.weight does not match its checksum: the checkpoint's files were "
        "damaged after they were written"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"], "no --out, no staging"


def test_an_export_that_fails_leaves_out_as_it_was(exported_run: Path, tmp_path: Path, capsys):
    """Truncated array files: one line naming the step, and neither a new ``--out`` nor an
    old one replaced with ``--force`` holds anything of the failed export."""
    run_dir = tmp_path / "run"
    shutil.copytree(exported_run, run_dir)
    truncate_array_files(run_dir / CHECKPOINT_DIR / "5")
    message = export_error(capsys, str(run_dir), "--out", str(tmp_path / "new"))
    assert message.startswith(f"step 5 of {run_dir} is damaged (")
    assert message.endswith(f"nothing was written to {tmp_path / 'new'}: export another --step")
    old = tmp_path / "old"
    old.mkdir()
    (old / "model.safetensors").write_text("an older export")
    export_error(capsys, str(run_dir), "--out", str(old), "--force")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["old", "run"]
    assert [path.name for path in old.iterdir()] == ["model.safetensors"]
    assert (old / "model.safetensors").read_text() == "an older export"


def test_export_never_writes_among_the_runs_files(exported_run: Path, tmp_path: Path, capsys):
    config = read_run_config(exported_run)
    data_dir = Path(config.data.path)
    for out, where in [
        (exported_run / "hf", f"the run directory {exported_run}"),
        (data_dir, f"its data directory {data_dir}"),
    ]:
        assert export_error(capsys, str(exported_run), "--out", str(out), "--force") == (
            f"--out {out} is inside {where}: export elsewhere"
        )
    parent = exported_run.parent
    assert export_error(capsys, str(exported_run), "--out", str(parent), "--force") == (
        f"--out {parent} holds the run directory {exported_run}: export elsewhere"
    )


def test_export_takes_relative_paths_through_symlinks_and_home(
    exported_run: Path, tmp_path: Path, monkeypatch, capsys
):
    """README's ``pipelines.export runs/tiny --out runs/tiny-hf``, with a link and ``~``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    Path("runs").mkdir()
    Path("runs/linked").symlink_to(exported_run)
    assert export.main(["runs/linked", "--out", "~/hf"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"exported step 5 of {exported_run} to ")
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "home" / "hf")


def test_an_export_needs_the_runs_tokenizer(exported_run: Path, tmp_path: Path, capsys):
    """A run that kept no tokenizer (older runs) exports its data's; with neither, nothing."""
    run_dir = tmp_path / "run"
    shutil.copytree(exported_run, run_dir)
    (run_dir / TOKENIZER_FILE).unlink()
    data_tokenizer = Path(read_run_config(run_dir).data.path) / TOKENIZER_FILE
    hidden = tmp_path / "hidden.json"
    shutil.move(data_tokenizer, hidden)
    try:
        assert export_error(capsys, str(run_dir), "--out", str(tmp_path / "out")) == (
            f"{run_dir} has no tokenizer: neither {run_dir / TOKENIZER_FILE} nor its data's "
            f"{data_tokenizer} exists (restore the data directory, or copy the tokenizer it "
            f"was prepared with to {run_dir / TOKENIZER_FILE})"
        )
    finally:
        shutil.move(hidden, data_tokenizer)
    assert not (tmp_path / "out").exists()


def test_an_export_gives_back_the_sources_config_generation_config_and_tokenizer(
    tmp_path: Path, capsys
):
    """A Llama-3-like source (131,072 positions, llama3 rope scaling, its own special token
    ids, generation config and tokenizer): every field of its ``config.json`` comes back
    equal, its generation config and tokenizer files too, and transformers loads it all."""
    architecture, fields, _ = HF_CASES["llama3_rope"]
    torch.manual_seed(0)
    config = hf_config(
        architecture,
        n_layers=4,
        **fields,
        max_position_embeddings=131072,
        bos_token_id=5,
        eos_token_id=[6, 7],
    )
    source = tmp_path / "source"
    model = randomize(getattr(transformers, architecture)(config))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=5, eos_token_id=[6, 7], temperature=0.6, top_p=0.9, do_sample=True
    )
    model.save_pretrained(source)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_byte_level_bpe(["def main(): return 0\n"], 300),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        model_max_length=131072,
    )
    tokenizer.save_pretrained(source)
    run_dir = checkpointed_run(source, tmp_path / "work", steps=(3,))
    assert sorted(path.name for path in (run_dir / HF_SOURCE_DIR).iterdir()) == sorted(
        path.name for path in source.iterdir() if path.name in HF_SOURCE_FILES
    )
    shutil.rmtree(source)  # the export needs nothing of the source any more
    out = tmp_path / "export"
    assert export.main([str(run_dir), "--out", str(out)]) == 0, capsys.readouterr().err
    exported = json.loads((out / "config.json").read_text())
    original = json.loads((run_dir / HF_SOURCE_DIR / "config.json").read_text())
    assert exported == original | {"dtype": "float32"}
    assert exported["max_position_embeddings"] == 131072
    assert exported["rope_parameters"]["rope_type"] == "llama3"
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (run_dir / HF_SOURCE_DIR / name).read_bytes(), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.max_position_embeddings == 131072
    assert loaded.generation_config.eos_token_id == [6, 7]
    text = "def main(): return 0"
    assert transformers.AutoTokenizer.from_pretrained(out)(text) == tokenizer(text)


def test_a_run_from_scratch_exports_what_it_used(tmp_path: Path, capsys):
    """No source config: the positions the run trained on and its end-of-document token as
    the start and end of a sequence, in ``config.json`` and ``generation_config.json``; the
    run's tokenizer with a ``tokenizer_config.json`` that ``AutoTokenizer`` loads."""
    run_dir = checkpointed_run(save_hf_model("llama_gqa", tmp_path / "hf"), tmp_path, steps=(1,))
    shutil.rmtree(run_dir / HF_SOURCE_DIR)
    out = tmp_path / "export"
    assert export.main([str(run_dir), "--out", str(out)]) == 0, capsys.readouterr().err
    exported = json.loads((out / "config.json").read_text())
    eod = train_byte_level_bpe(["def main(): return 0\n"], 300).token_to_id("<|endoftext|>")
    assert exported["max_position_embeddings"] == 8  # the run's data.seq_len
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (eod, eod)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (eod, eod)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == eod
    assert tokenizer.decode(tokenizer("def main()")["input_ids"]) == "def main()"
    assert transformers.AutoModelForCausalLM.from_pretrained(out).config.eos_token_id == eod


def test_export_refuses_a_family_without_a_hugging_face_architecture(tmp_path: Path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = RunConfig(data=DataConfig(vocab_size=300), mesh=MESH, pipeline=CIRCULAR)
    (run_dir / CONFIG_FILE).write_text(config_to_toml(config))
    message = export_error(capsys, str(run_dir), "--out", str(tmp_path / "out"))
    assert message.startswith("family: 'decoder' has no Hugging Face architecture; use ")


def test_the_dry_run_checks_the_checkpoint_without_reading_its_weights(llama_dir, tmp_path):
    """Every value overwritten with garbage: the dry run, which reads only the headers,
    still plans the run and names the checkpoint."""
    from eqxzoo.run.plan import dry_run

    garbled = tmp_path / "garbled"
    shutil.copytree(llama_dir, garbled)
    weights = garbled / "model.safetensors"
    header_length = int.from_bytes(weights.read_bytes()[:8], "little")
    data = bytearray(weights.read_bytes())
    data[8 + header_length :] = b"\xff" * (len(data) - 8 - header_length)
    weights.write_bytes(bytes(data))
    config = hf_run_config(garbled, tmp_path)
    lines: list[str] = []
    figures = dry_run(config, say=lines.append)
    assert figures["parameters"] > 0
    assert any(
        line.startswith(f"parameters from the Hugging Face checkpoint {garbled}: ")
        and line.endswith("names, shapes and dtypes checked (a dry run reads no weights)")
        for line in lines
    ), lines
