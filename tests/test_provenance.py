"""The tokenizer travels with the weights (`eqxzoo.run.provenance`): a run from a Hugging
Face checkpoint trains only on data its own tokenizer tokenized (compared by what the
tokenizers compute, not their size), a resume only on the tokenizer it started with, and a
run keeps its tokenizer and its source's files, so that generation and export never need
the data or the source directory again.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
from hf_models import hf_config
from runs import run_command

from eqxzoo.data import DataError, PrepareOptions, load_tokenizer, prepare_corpus
from eqxzoo.data.manifest import TOKENIZER_FILE, file_sha256
from eqxzoo.data.tokenizer import tokenization_differences, train_byte_level_bpe
from eqxzoo.run.config import config_from_dict
from eqxzoo.run.provenance import (
    HF_SOURCE_DIR,
    check_hf_tokenizer,
    check_run_tokenizer,
    keep_run_sources,
    run_tokenizer_file,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")
LLAMA = hf_config(
    "LlamaForCausalLM",
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
)

CODE = ["def main():\n    return 0\n", "class Point:\n    x: int = 0\n    y: int = 0\n"] * 8
PROSE = ["the quick brown fox jumps over the lazy dog\n", "a stitch in time saves nine\n"] * 8


def tokenizer_file(directory: Path, texts: list[str], vocab_size: int = 280) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    train_byte_level_bpe(texts, vocab_size).save(str(directory / TOKENIZER_FILE))
    return directory / TOKENIZER_FILE


def prepared(tmp_path: Path, name: str, tokenizer: Path) -> Path:
    """A corpus prepared by ``pipelines.prepare``'s code with ``--tokenizer tokenizer``."""
    inputs = tmp_path / f"{name}.txt"
    inputs.write_text("".join(CODE))
    options = PrepareOptions(tokenizer_file=tokenizer, val_fraction=0.0)
    return prepare_corpus([inputs], tmp_path / name, options).out_dir


def hf_run(hf_dir: Path, data: str = "stdlib"):
    data_table = {"path": data, "vocab_size": 300}
    return config_from_dict({"model": {"init_from_hf": str(hf_dir)}, "data": data_table})


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """A stand-in Hugging Face checkpoint directory: what the checks read is its tokenizer,
    here written compactly (as the Hub's files often are), unlike ``tokenizers``' own."""
    path = tokenizer_file(tmp_path / "hf", CODE)
    path.write_text(json.dumps(json.loads(path.read_text())))
    LLAMA.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_data_prepared_with_the_checkpoints_tokenizer_is_accepted(hf_dir, tmp_path):
    data = prepared(tmp_path, "data", hf_dir / TOKENIZER_FILE)
    assert (data / TOKENIZER_FILE).read_bytes() != (hf_dir / TOKENIZER_FILE).read_bytes()
    assert check_hf_tokenizer(hf_run(hf_dir, str(data)), data) is None


def test_another_tokenizer_of_the_same_size_is_refused_naming_both(hf_dir, tmp_path):
    other = tokenizer_file(tmp_path / "other", PROSE)
    data = prepared(tmp_path, "data", other)
    theirs = hf_dir / TOKENIZER_FILE
    sizes = {train_byte_level_bpe(texts, 280).get_vocab_size() for texts in (CODE, PROSE)}
    assert len(sizes) == 1, "the same size: only the content tells them apart"
    (size,) = sizes
    with pytest.raises(DataError) as refused:
        check_hf_tokenizer(hf_run(hf_dir, str(data)), data)
    assert str(refused.value) == (
        f"data.path {data} is not tokenized by model.init_from_hf's tokenizer "
        f"({data / TOKENIZER_FILE}: {size} tokens, sha256 "
        f"{file_sha256(data / TOKENIZER_FILE)[:12]}; {theirs}: {size} tokens, sha256 "
        f"{file_sha256(theirs)[:12]}; they differ in model): prepare the corpus with "
        f"`python -m pipelines.prepare INPUTS --out DATA --tokenizer {theirs}` and set "
        "data.path = DATA"
    )


def test_the_builtin_corpus_is_refused_for_a_checkpoint(hf_dir, tmp_path):
    """``data.path = "stdlib"`` (the default) is tokenized by a BPE trained here."""
    stdlib_like = tokenizer_file(tmp_path / "stdlib", PROSE).parent
    with pytest.raises(DataError, match=r'^data\.path = "stdlib" \(the built-in corpus, tok'):
        check_hf_tokenizer(hf_run(hf_dir), stdlib_like)


def test_a_checkpoint_without_a_tokenizer_is_a_warning(hf_dir, tmp_path):
    (hf_dir / TOKENIZER_FILE).unlink()
    assert check_hf_tokenizer(hf_run(hf_dir), tmp_path) == (
        f"model.init_from_hf {hf_dir} has no tokenizer.json: nothing tells whether data.path "
        "was tokenized for this checkpoint"
    )


def test_tokenizers_compare_by_what_they_compute():
    reference = train_byte_level_bpe(CODE, 280)
    same = train_byte_level_bpe(CODE, 280)
    assert tokenization_differences(same, reference) == []
    assert tokenization_differences(train_byte_level_bpe(PROSE, 280), reference) == ["model"]
    extended = train_byte_level_bpe(CODE, 280)
    extended.add_special_tokens(["<|im_start|>"])
    assert tokenization_differences(extended, reference) == [], "a token more is no difference"
    assert tokenization_differences(reference, extended) == ["added tokens '<|im_start|>'"]


def test_a_run_keeps_its_tokenizer_and_its_sources_files(hf_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = prepared(tmp_path, "data", hf_dir / TOKENIZER_FILE)
    (hf_dir / "generation_config.json").write_text('{"eos_token_id": 2}\n')
    config = hf_run(hf_dir, str(data))
    keep_run_sources(run_dir, config, data, fresh=True)
    assert (run_dir / TOKENIZER_FILE).read_bytes() == (data / TOKENIZER_FILE).read_bytes()
    kept = run_dir / HF_SOURCE_DIR
    assert sorted(path.name for path in kept.iterdir()) == [
        "config.json",
        "generation_config.json",
        TOKENIZER_FILE,
    ]
    assert (kept / TOKENIZER_FILE).read_bytes() == (hf_dir / TOKENIZER_FILE).read_bytes()
    shutil.rmtree(data)
    shutil.rmtree(hf_dir)
    assert run_tokenizer_file(run_dir, config) == run_dir / TOKENIZER_FILE


def test_a_resume_on_data_tokenized_otherwise_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    data = tokenizer_file(tmp_path / "data", CODE).parent
    config = config_from_dict({"data": {"path": str(data)}})
    run_dir.mkdir()
    keep_run_sources(run_dir, config, data, fresh=True)
    check_run_tokenizer(run_dir, data)
    tokenizer_file(data, PROSE)  # the corpus re-prepared under the same data.path
    with pytest.raises(DataError, match=rf"^data\.path {data} is no longer tokenized by this run"):
        check_run_tokenizer(run_dir, data)
    keep_run_sources(run_dir, config, data, fresh=False)
    kept = load_tokenizer(run_dir / TOKENIZER_FILE)
    assert tokenization_differences(train_byte_level_bpe(CODE, 280), kept) == [], (
        "a resume never replaces the tokenizer a run kept"
    )


def test_a_run_on_the_wrong_tokenizer_stops_before_anything(hf_dir, tmp_path, cache_dir):
    """Through ``pipelines.run``: one line, exit 2, nothing written in the run directory."""
    transformers.LlamaForCausalLM(LLAMA).save_pretrained(hf_dir)
    data = prepared(tmp_path, "data", tokenizer_file(tmp_path / "other", PROSE))
    run_dir = tmp_path / "run"
    config = tmp_path / "finetune.toml"
    config.write_text(
        f'[model]\ninit_from_hf = "{hf_dir}"\n[data]\npath = "{data}"\nseq_len = 16\n'
        f'batch_size = 2\n[run]\nsteps = 2\ncompilation_cache_dir = "{cache_dir}"\n'
        "[optimizer]\nwarmup_steps = 1\n"
    )
    command = [sys.executable, "-m", "pipelines.run", str(config), "--run-dir", str(run_dir)]
    result = run_command(command, expect=2)
    assert result.stderr.startswith(f"error: data.path {data} is not tokenized by model.init_")
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert sorted(path.name for path in run_dir.iterdir()) == ["run.lock"]


def test_generation_and_export_read_the_runs_own_tokenizer(tmp_path):
    data = tokenizer_file(tmp_path / "data", CODE).parent
    config = config_from_dict({"data": {"path": str(data)}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert run_tokenizer_file(run_dir, config) == data / TOKENIZER_FILE, "a run from before"
    keep_run_sources(run_dir, config, data, fresh=True)
    shutil.rmtree(data)
    assert run_tokenizer_file(run_dir, config) == run_dir / TOKENIZER_FILE
