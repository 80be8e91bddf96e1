"""Paths as a user types them: relative to the working directory, with ``~``, through
symlinks, resolved once where each command reads them (`pipelines.cli.absolute_path`, the
config's `PATH_KEYS`). README's own commands, relative paths and all, run verbatim in
`test_readme_commands.py`; the export's in `test_hf_train.py`.
"""

import json
from pathlib import Path

import jax
import pytest
from hf_models import hf_config

from eqxzoo.data.manifest import TOKENIZER_FILE
from eqxzoo.data.tokenizer import train_byte_level_bpe
from eqxzoo.run.config import config_from_dict, config_to_dict, load_config
from eqxzoo.run.rundir import CHECKPOINT_DIR
from eqxzoo.runtime import enable_compilation_cache
from eqxzoo.train.checkpoint import CheckpointError
from eqxzoo.train.saved_arrays import saved_arrays
from pipelines.generate import main as generate_main
from pipelines.prepare import main as prepare_main


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    """A working directory ``tmp_path/work`` and a home ``tmp_path/home``."""
    (tmp_path / "work").mkdir()
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_configs_paths_are_absolute(home: Path, tmp_path: Path):
    (tmp_path / "data").mkdir()
    (tmp_path / "work" / "corpus").symlink_to(tmp_path / "data")
    document = {"data": {"path": "corpus"}}
    config = config_from_dict(document)
    assert config.data.path == str(tmp_path / "data"), "relative, through the symlink"
    settings = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    previous = {name: getattr(jax.config, name) for name in settings}
    try:
        assert enable_compilation_cache("cache") == tmp_path / "work" / "cache"
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
    assert config_to_dict(config)["data"]["path"] == str(tmp_path / "data")
    assert config_from_dict({"data": {"path": "stdlib"}}).data.path == "stdlib"
    transformers = pytest.importorskip("transformers")
    llama = hf_config("LlamaForCausalLM", vocab_size=320, hidden_size=32, num_attention_heads=4)
    llama.save_pretrained(home / "llama")
    from_hf = config_from_dict({"model": {"init_from_hf": "~/llama"}, "data": {"vocab_size": 300}})
    assert from_hf.init_from_hf == str(home / "llama")
    assert transformers.AutoConfig.from_pretrained(from_hf.init_from_hf).vocab_size == 320
    toml = tmp_path / "work" / "run.toml"
    toml.write_text('[data]\npath = "../data"\n')
    assert load_config("run.toml").data.path == str(tmp_path / "data")
    assert load_config("run.toml", ["data.path=~/elsewhere"]).data.path == str(home / "elsewhere")


def test_prepare_takes_relative_inputs_out_and_tokenizer(home: Path, tmp_path: Path, capsys):
    (tmp_path / "work" / "text").mkdir()
    (tmp_path / "work" / "text" / "a.txt").write_text("def main():\n    return 0\n" * 20)
    train_byte_level_bpe(["def main(): return 0\n"], 280).save(str(home / TOKENIZER_FILE))
    argv = ["text", "--out", "prepared", "--tokenizer", "~/tokenizer.json", "--val-fraction", "0"]
    assert prepare_main(argv) == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "work" / "prepared" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] == 1
    assert manifest["options"]["tokenizer"]["file"] == str(home / TOKENIZER_FILE)


def test_generate_takes_a_relative_run_directory(reference_dir: Path, monkeypatch, capsys):
    monkeypatch.chdir(reference_dir.parent)
    argv = [reference_dir.name, "--prompt", "def", "--max-new-tokens", "2", "--temperature", "0"]
    assert generate_main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("(step 6) def")


def test_a_checkpoint_path_that_names_nothing_says_so(home: Path):
    """The path is the problem, not the checkpoint: no "unreadable metadata", no "damaged"."""
    with pytest.raises(CheckpointError) as error:
        saved_arrays(Path("runs") / "tiny" / CHECKPOINT_DIR / "300")
    where = Path.cwd() / "runs" / "tiny" / CHECKPOINT_DIR / "300"
    assert str(error.value) == f"{where} does not exist: no checkpoint step there"
