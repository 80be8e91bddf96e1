"""Where a run's tokens and weights came from, kept with the run.

A model is only as good as the tokenizer its ids mean: a run from a Hugging Face checkpoint
(``model.init_from_hf``) must train on data tokenized by the checkpoint's own tokenizer
(`check_hf_tokenizer`, compared by what the tokenizers compute, not by their size), and a
run must keep training on the tokenizer it started with (`check_run_tokenizer`).

Every run keeps its tokenizer in ``RUN_DIR/tokenizer.json``, and a run from a Hugging Face
checkpoint keeps the source's own ``config.json``, generation config and tokenizer files in
``RUN_DIR/hf_source/`` (`keep_run_sources`), so that ``pipelines.generate`` and
``pipelines.export`` never depend on the data directory or the source checkpoint still
existing (`run_tokenizer_file`, `hf_source_dir`).
"""

import shutil
from pathlib import Path

from eqxzoo.data.manifest import TOKENIZER_FILE, DataError, file_sha256, read_manifest
from eqxzoo.data.prepare import default_stdlib_cache_dir, load_tokenizer, prepare_stdlib_corpus
from eqxzoo.data.tokenizer import tokenization_differences
from eqxzoo.errors import UserError
from eqxzoo.run.config import RunConfig

HF_SOURCE_DIR = "hf_source"
# What an export carries over from the source checkpoint, where it has them.
HF_SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


def data_directory(config: RunConfig, *, prepare: bool = True) -> Path:
    """The prepared corpus: ``data.path``, or the built-in stdlib corpus's directory, prepared
    on first use (unless not ``prepare``: a command that only reads its tokenizer)."""
    if not config.data.is_stdlib:
        return Path(config.data.path).expanduser()
    if prepare:
        return prepare_stdlib_corpus(vocab_size=config.data.vocab_size)
    return default_stdlib_cache_dir(config.data.vocab_size)


def batches_carry_documents(config: RunConfig) -> bool:
    """Whether the run's batches carry packed documents (segments and positions):
    ``data.document_mask``, or when unset, as the prepared data's formats decide
    (`eqxzoo.data.manifest.masks_documents`; the built-in corpus is plain text). Reads the
    manifest only (a dry run opens no data); data not prepared yet counts as plain text."""
    if config.data.document_mask is not None or config.data.is_stdlib:
        return bool(config.data.document_mask)
    try:
        manifest = read_manifest(data_directory(config))
    except DataError:
        return False
    return manifest.document_mask(None)


def _describe(path: Path) -> str:
    tokenizer = load_tokenizer(path)
    return f"{path}: {tokenizer.get_vocab_size()} tokens, sha256 {file_sha256(path)[:12]}"


def check_hf_tokenizer(config: RunConfig, data_dir: Path) -> str | None:
    """Refuse data that ``model.init_from_hf``'s own tokenizer did not tokenize (a
    `DataError` naming both tokenizers and how to prepare the corpus with the checkpoint's);
    a warning line when the checkpoint has no ``tokenizer.json`` to compare with."""
    hf_dir = Path(config.init_from_hf).expanduser()
    theirs = hf_dir / TOKENIZER_FILE
    if not theirs.is_file():
        return (
            f"model.init_from_hf {hf_dir} has no {TOKENIZER_FILE}: nothing tells whether "
            f"data.path was tokenized for this checkpoint"
        )
    ours = data_dir / TOKENIZER_FILE
    differences = tokenization_differences(load_tokenizer(ours), load_tokenizer(theirs))
    if not differences:
        return None
    data = (
        'data.path = "stdlib" (the built-in corpus, tokenized by a BPE trained here)'
        if config.data.is_stdlib
        else f"data.path {data_dir}"
    )
    raise DataError(
        f"{data} is not tokenized by model.init_from_hf's tokenizer ({_describe(ours)}; "
        f"{_describe(theirs)}; they differ in {', '.join(differences)}): prepare the corpus "
        f"with `python -m pipelines.prepare INPUTS --out DATA --tokenizer {theirs}` and set "
        "data.path = DATA"
    )


def check_run_tokenizer(run_dir: Path, data_dir: Path) -> None:
    """Refuse to resume a run whose data is now tokenized otherwise than the tokenizer it
    kept (a corpus re-prepared under the same ``data.path``)."""
    kept = run_dir / TOKENIZER_FILE
    if not kept.is_file():
        return
    differences = tokenization_differences(
        load_tokenizer(data_dir / TOKENIZER_FILE), load_tokenizer(kept)
    )
    if differences:
        raise DataError(
            f"data.path {data_dir} is no longer tokenized by this run's tokenizer "
            f"({_describe(data_dir / TOKENIZER_FILE)}; the run's {_describe(kept)}; they "
            f"differ in {', '.join(differences)}): give the run its own data back, or start "
            "a new run in another --run-dir"
        )


def keep_run_sources(run_dir: Path, config: RunConfig, data_dir: Path, *, fresh: bool) -> None:
    """Keep the run's tokenizer (copied from its data at a ``fresh`` start, or at a resume
    of a run from before runs kept one) and, for a
    ``fresh`` run from a Hugging Face checkpoint, the source's config, generation config and
    tokenizer files in ``hf_source/``. Process 0 only, once every check has passed."""
    kept = run_dir / TOKENIZER_FILE
    if fresh or not kept.is_file():
        _copy_atomically(data_dir / TOKENIZER_FILE, kept)
    if fresh and config.init_from_hf:
        source = Path(config.init_from_hf).expanduser()
        destination = run_dir / HF_SOURCE_DIR
        destination.mkdir(exist_ok=True)
        for name in HF_SOURCE_FILES:
            if (source / name).is_file():
                _copy_atomically(source / name, destination / name)
            else:
                (destination / name).unlink(missing_ok=True)


def _copy_atomically(source: Path, destination: Path) -> None:
    partial = destination.with_name(destination.name + ".partial")
    shutil.copyfile(source, partial)
    partial.replace(destination)


def run_tokenizer_file(run_dir: Path, config: RunConfig) -> Path:
    """The tokenizer a run trained with: its own copy, or (a run from before runs kept one)
    its data directory's; a `UserError` naming both places when neither exists."""
    kept = run_dir / TOKENIZER_FILE
    if kept.is_file():
        return kept
    in_data = data_directory(config, prepare=False) / TOKENIZER_FILE
    if in_data.is_file():
        return in_data
    raise UserError(
        f"{run_dir} has no tokenizer: neither {kept} nor its data's {in_data} exists "
        "(restore the data directory, or copy the tokenizer it was prepared with to "
        f"{kept})"
    )


def hf_source_dir(run_dir: Path) -> Path | None:
    """The source checkpoint's files a run from Hugging Face kept (None for other runs)."""
    directory = run_dir / HF_SOURCE_DIR
    return directory if (directory / "config.json").is_file() else None
