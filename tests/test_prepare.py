"""Corpus preparation: shards round-trip, splits, sharding, re-runs, partial output, bad input."""

import dataclasses
import gzip
import json
import random
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader

from eqxzoo.data import prepare as prep
from eqxzoo.data.manifest import Manifest, decode_record, read_manifest, verify_shards
from eqxzoo.data.shards import ShardWriter
from eqxzoo.data.sources import assign_validation, stdlib_source_files
from eqxzoo.data.tokenizer import EOD_TOKEN, decode_document, encode_documents
from pipelines.prepare import main

VOCAB = 300
WORDS = (
    "the model reads tokens from shards and learns to predict the next one while "
    "pipelines pass activations between stages écrire 日本語 def return lambda"
).split()


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Distinct small documents (each starts with its index), some with non-ASCII text."""
    rng = random.Random(seed)
    return [
        f"doc {index}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) + "\n"
        for index in range(count)
    ]


def write_text_files(directory: Path, documents: list[str]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, text in enumerate(documents):
        path = directory / f"{index:03d}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def read_split(out_dir: Path, manifest: Manifest, split: str) -> list[list[int]]:
    """Every record of a split's shards, in shard order, as token-id lists."""
    documents = []
    for shard in manifest.splits[split].shards:
        reader = ArrayRecordReader(str(out_dir / shard.file))
        documents.extend(decode_record(record).tolist() for record in reader.read_all())
        reader.close()
    return documents


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def prepare(inputs: list[Path], out_dir: Path, **options: object) -> prep.PrepareResult:
    options = {"vocab_size": VOCAB, **options}
    return prep.prepare_corpus(inputs, out_dir, prep.PrepareOptions(**options))


def test_round_trip_splits_and_counts(tmp_path: Path):
    documents = make_documents(60)
    files = write_text_files(tmp_path / "corpus", documents)
    out_dir = tmp_path / "out"
    result = prepare(files, out_dir, val_fraction=0.1)

    manifest = read_manifest(out_dir)
    assert manifest == result.manifest
    tokenizer = prep.load_tokenizer(out_dir / "tokenizer.json")
    assert manifest.tokenizer.eod_token_id == tokenizer.token_to_id(EOD_TOKEN)
    assert manifest.tokenizer.vocab_size == tokenizer.get_vocab_size() <= VOCAB
    expected = {text: ids for text, ids in zip(documents, encode_documents(tokenizer, documents))}

    seen: dict[str, str] = {}
    for split in ("train", "val"):
        split_documents = read_split(out_dir, manifest, split)
        info = manifest.splits[split]
        assert info.documents == len(split_documents)
        assert info.tokens == sum(len(ids) for ids in split_documents)
        for shard in info.shards:
            reader = ArrayRecordReader(str(out_dir / shard.file))
            records = [decode_record(record) for record in reader.read_all()]
            reader.close()
            assert shard.records == len(records)
            assert shard.tokens == sum(len(ids) for ids in records)
            assert shard.bytes == (out_dir / shard.file).stat().st_size
        for ids in split_documents:
            assert manifest.tokenizer.eod_token_id not in ids  # the loader adds EOD
            text = decode_document(tokenizer, ids)
            assert text not in seen, "a document appears twice"
            seen[text] = split
            assert ids == expected[text]
    assert set(seen) == set(documents)
    assert 1 <= manifest.splits["val"].documents < len(documents) // 2
    assert manifest.token_dtype == "<u4"
    verify_shards(out_dir)


def test_jsonl_custom_field_gzip_and_literal_eod(tmp_path: Path):
    documents = make_documents(12) + [f"quoting {EOD_TOKEN} inside a document"]
    jsonl = tmp_path / "part.jsonl.gz"
    with gzip.open(jsonl, "wt", encoding="utf-8") as file:
        for text in documents:
            file.write(json.dumps({"body": text, "id": 1}) + "\n\n")
    text_gz = tmp_path / "extra.txt.gz"
    with gzip.open(text_gz, "wt", encoding="utf-8") as file:
        file.write("a gzipped text file\n")
    out_dir = tmp_path / "out"
    manifest = prepare([jsonl, text_gz], out_dir, text_field="body").manifest

    tokenizer = prep.load_tokenizer(out_dir / "tokenizer.json")
    decoded = [
        decode_document(tokenizer, ids)
        for split in ("train", "val")
        for ids in read_split(out_dir, manifest, split)
    ]
    assert sorted(decoded) == sorted(documents + ["a gzipped text file\n"])
    for split in ("train", "val"):
        for ids in read_split(out_dir, manifest, split):
            assert manifest.tokenizer.eod_token_id not in ids  # the literal string stays text
    assert manifest.options["text_field"] == "body"


def test_directories_walked_in_order_skipping_binary_hidden_and_output(tmp_path: Path):
    corpus = tmp_path / "corpus"
    write_text_files(corpus / "b", make_documents(3, seed=1))
    write_text_files(corpus / "a" / "deep", make_documents(4, seed=2))
    (corpus / "notes.md").write_text("# notes\n", encoding="utf-8")
    (corpus / "empty.txt").write_text("", encoding="utf-8")
    (corpus / "blob.bin").write_bytes(bytes(range(256)))
    (corpus / ".hidden").mkdir()
    (corpus / ".hidden" / "secret.txt").write_text("never read", encoding="utf-8")
    out_dir = corpus / "prepared"  # inside the input: must not feed itself
    result = prepare([corpus], out_dir)

    assert result.skipped_files == (corpus / "blob.bin",)
    paths = [Path(info.path) for info in result.manifest.inputs]
    assert paths == sorted(paths)  # walked in sorted order
    assert all(".hidden" not in path.parts and "prepared" not in path.parts for path in paths)
    documents = sum(split.documents for split in result.manifest.splits.values())
    assert documents == 3 + 4 + 1  # the empty file is no document
    assert prepare([corpus], out_dir).up_to_date  # its own output changed nothing


def test_records_per_shard(tmp_path: Path):
    files = write_text_files(tmp_path / "corpus", make_documents(23))
    out_dir = tmp_path / "out"
    manifest = prepare(files, out_dir, records_per_shard=4, val_fraction=0.2).manifest
    train = manifest.splits["train"]
    assert len(train.shards) >= 3
    assert [shard.file for shard in train.shards] == [
        f"train-{index:05d}.array_record" for index in range(len(train.shards))
    ]
    assert all(shard.records == 4 for shard in train.shards[:-1])
    assert 1 <= train.shards[-1].records <= 4
    assert manifest.splits["val"].shards[0].file == "val-00000.array_record"
    assert sum(split.documents for split in manifest.splits.values()) == 23


def test_rerun_is_a_no_op_until_inputs_or_options_change(tmp_path: Path, capsys):
    files = write_text_files(tmp_path / "corpus", make_documents(8))
    out_dir = tmp_path / "out"
    argv = [*map(str, files), "--out", str(out_dir), "--vocab-size", str(VOCAB)]
    assert run_cli(argv, capsys)[0] == 0
    manifest_mtime = (out_dir / "manifest.json").stat().st_mtime_ns

    code, stdout, _ = run_cli(argv, capsys)
    assert code == 0 and "up to date" in stdout
    assert (out_dir / "manifest.json").stat().st_mtime_ns == manifest_mtime

    code, stdout, _ = run_cli([*argv, "--val-fraction", "0.5"], capsys)
    assert code == 0 and "up to date" not in stdout
    files[0].write_text("changed content\n", encoding="utf-8")
    code, stdout, _ = run_cli([*argv, "--val-fraction", "0.5"], capsys)
    assert code == 0 and "up to date" not in stdout
    assert read_manifest(out_dir).options["val_fraction"] == 0.5


def test_partial_output_is_not_taken_as_finished(tmp_path: Path):
    files = write_text_files(tmp_path / "corpus", make_documents(10))
    finished = tmp_path / "finished"
    prepare(files, finished)
    out_dir = tmp_path / "out"
    # A run killed before its rename: a full staging directory beside an absent output.
    staging = tmp_path / ".out.partial-killed"
    staging.mkdir()
    for path in finished.iterdir():
        (staging / path.name).write_bytes(path.read_bytes())
    with pytest.raises(prep.DataError, match="no manifest.json"):
        read_manifest(out_dir)

    result = prepare(files, out_dir)
    assert not result.up_to_date
    assert not staging.exists()  # the stale staging directory was cleaned up
    verify_shards(out_dir)
    assert not list(tmp_path.glob(".out.partial-*"))


def test_same_inputs_give_identical_shards_and_loaded_tokenizer_reproduces(tmp_path: Path):
    files = write_text_files(tmp_path / "corpus", make_documents(15))
    first = prepare(files, tmp_path / "first").manifest
    second = prepare(files, tmp_path / "second").manifest
    assert first.splits == second.splits and first.tokenizer == second.tokenizer
    reused = prep.prepare_corpus(
        files,
        tmp_path / "reused",
        prep.PrepareOptions(tokenizer_file=tmp_path / "first" / "tokenizer.json"),
    ).manifest
    assert reused.splits == first.splits
    assert reused.options["tokenizer"]["sha256"] == first.tokenizer.sha256


def test_verify_shards_names_the_corrupt_shard(tmp_path: Path):
    files = write_text_files(tmp_path / "corpus", make_documents(12))
    out_dir = tmp_path / "out"
    manifest = prepare(files, out_dir, records_per_shard=3).manifest
    assert verify_shards(out_dir) == manifest
    shard = out_dir / manifest.splits["train"].shards[1].file
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(prep.DataError, match="train-00001.array_record is corrupt"):
        verify_shards(out_dir)
    shard.unlink()
    with pytest.raises(prep.DataError, match="train-00001.array_record is missing"):
        verify_shards(out_dir)


def test_assign_validation_bounds():
    scores = np.asarray([0.9, 0.5, 0.7], dtype=np.float64)
    assert assign_validation(scores, 0.01).tolist() == [False, True, False]
    assert assign_validation(scores, 0.0).tolist() == [False, False, False]
    assert assign_validation(scores, 0.99).tolist() == [False, True, True]
    assert assign_validation(np.asarray([0.001]), 0.5).tolist() == [False]


def bad_jsonl(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


BAD_INPUTS = {
    "missing path": (lambda tmp: [str(tmp / "nope.txt")], "input .*nope.txt does not exist"),
    "empty directory": (lambda tmp: [str(tmp / "empty_dir")], "no usable documents"),
    "empty file": (lambda tmp: [str(tmp / "empty.txt")], "no usable documents"),
    "invalid json": (
        lambda tmp: [str(bad_jsonl(tmp, ['{"text": "ok"}', "{not json"]))],
        r"bad.jsonl:2: not valid JSON",
    ),
    "missing field": (
        lambda tmp: [str(bad_jsonl(tmp, ['{"body": "x"}'])), "--text-field", "text"],
        r"bad.jsonl:1: no field 'text'",
    ),
    "field not a string": (
        lambda tmp: [str(bad_jsonl(tmp, ['{"text": "ok"}', '{"text": 3}']))],
        r"bad.jsonl:2: field 'text' is int, not a string",
    ),
    "binary file named": (lambda tmp: [str(tmp / "blob.bin")], "blob.bin: not UTF-8 text"),
    "bad tokenizer": (
        lambda tmp: [str(tmp / "good.txt"), "--tokenizer", str(tmp / "good.txt")],
        "cannot load tokenizer .*good.txt",
    ),
    "missing tokenizer": (
        lambda tmp: [str(tmp / "good.txt"), "--tokenizer", str(tmp / "none.json")],
        "tokenizer .*none.json does not exist",
    ),
    "vocab too small": (
        lambda tmp: [str(tmp / "good.txt"), "--vocab-size", "256"],
        "--vocab-size must be >= 257",
    ),
    "tokenizer and vocab": (
        lambda tmp: [str(tmp / "good.txt"), "--vocab-size", "300", "--tokenizer", "t.json"],
        "either --tokenizer or --vocab-size",
    ),
    "no inputs": (lambda tmp: [], "no inputs"),
    "corrupt gzip": (lambda tmp: [str(tmp / "broken.txt.gz")], "broken.txt.gz: not a valid gzip"),
    "val fraction": (
        lambda tmp: [str(tmp / "good.txt"), "--val-fraction", "1.5"],
        r"--val-fraction must be in \[0, 1\)",
    ),
    "records per shard": (
        lambda tmp: [str(tmp / "good.txt"), "--records-per-shard", "0"],
        "--records-per-shard must be >= 1",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, case: str):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "good.txt").write_text("some good text\n", encoding="utf-8")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    (tmp_path / "broken.txt.gz").write_bytes(b"\x1f\x8b not really gzip")
    make_args, message = BAD_INPUTS[case]
    out_dir = tmp_path / "out"
    code, stdout, stderr = run_cli([*make_args(tmp_path), "--out", str(out_dir)], capsys)
    assert code == 2
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr
    assert re.search(message, stderr), stderr
    assert not (out_dir / "manifest.json").exists()


def test_refuses_to_replace_a_foreign_directory(tmp_path: Path, capsys):
    """Without a manifest nothing in a directory is prepare's, even files of its names."""
    (tmp_path / "good.txt").write_text("some good text\n", encoding="utf-8")
    foreign = tmp_path / "home"
    foreign.mkdir()
    names = ["precious.txt", "tokenizer.json", *(f"note-{index}.md" for index in range(5))]
    for name in names:
        (foreign / name).write_text("keep me", encoding="utf-8")
    code, _, stderr = run_cli([str(tmp_path / "good.txt"), "--out", str(foreign)], capsys)
    assert code == 2
    assert stderr == (
        f"error: --out {foreign} holds entries pipelines.prepare did not write: note-0.md, "
        "note-1.md, note-2.md, note-3.md, note-4.md and 2 more; choose another --out or move "
        "them out of it\n"
    )
    assert sorted(path.name for path in foreign.iterdir()) == sorted(names)
    assert all((foreign / name).read_text(encoding="utf-8") == "keep me" for name in names)


def prepared_files(out_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in out_dir.iterdir() if path.is_file()}


def test_rerun_refuses_an_output_holding_foreign_entries(tmp_path: Path, capsys):
    files = write_text_files(tmp_path / "corpus", make_documents(8))
    out_dir = tmp_path / "out"
    argv = [*map(str, files), "--out", str(out_dir)]
    assert run_cli([*argv, "--vocab-size", str(VOCAB)], capsys)[0] == 0
    earlier = prepared_files(out_dir)
    (out_dir / "NOTES.md").write_text("my notes\n", encoding="utf-8")
    (out_dir / "runs").mkdir()
    (out_dir / "runs" / "metrics.jsonl").write_text("{}\n", encoding="utf-8")

    code, stdout, stderr = run_cli([*argv, "--vocab-size", str(VOCAB + 20)], capsys)
    assert code == 2
    assert stderr == (
        f"error: --out {out_dir} holds entries pipelines.prepare did not write: NOTES.md, "
        "runs/; choose another --out or move them out of it\n"
    )
    assert "reading" not in stdout  # refused before any work
    assert (out_dir / "NOTES.md").read_text(encoding="utf-8") == "my notes\n"
    assert (out_dir / "runs" / "metrics.jsonl").read_text(encoding="utf-8") == "{}\n"
    assert prepared_files(out_dir) == {**earlier, "NOTES.md": b"my notes\n"}
    verify_shards(out_dir)
    assert not list(tmp_path.glob(".out.partial-*"))


def test_rerun_into_its_own_output_replaces_it(tmp_path: Path, capsys):
    files = write_text_files(tmp_path / "corpus", make_documents(30))
    out_dir = tmp_path / "out"
    argv = [*map(str, files), "--out", str(out_dir), "--records-per-shard", "2"]
    assert run_cli([*argv, "--vocab-size", str(VOCAB)], capsys)[0] == 0
    earlier = read_manifest(out_dir)
    code, stdout, _ = run_cli(
        [*argv, "--vocab-size", str(VOCAB + 20), "--val-fraction", "0"], capsys
    )
    assert code == 0 and "up to date" not in stdout
    manifest = verify_shards(out_dir)
    assert manifest.options["tokenizer"] == {"train_vocab_size": VOCAB + 20}
    assert manifest != earlier
    shards = {shard.file for split in manifest.splits.values() for shard in split.shards}
    assert {path.name for path in out_dir.iterdir()} == shards | {"manifest.json", "tokenizer.json"}
    assert not list(tmp_path.glob(".out.partial-*"))


def test_entries_appearing_during_a_run_are_kept(tmp_path: Path, monkeypatch, capsys):
    """The check is made again just before the old output is replaced."""
    files = write_text_files(tmp_path / "corpus", make_documents(8))
    out_dir = tmp_path / "out"
    earlier = prepare(files, out_dir).manifest
    train = prep.train_byte_level_bpe

    def train_while_someone_writes(documents, vocab_size):
        (out_dir / "NOTES.md").write_text("written meanwhile\n", encoding="utf-8")
        return train(documents, vocab_size)

    monkeypatch.setattr(prep, "train_byte_level_bpe", train_while_someone_writes)
    argv = [*map(str, files), "--out", str(out_dir), "--vocab-size", str(VOCAB + 20)]
    code, _, stderr = run_cli(argv, capsys)
    assert code == 2
    assert stderr == (
        f"error: --out {out_dir} holds entries pipelines.prepare did not write: NOTES.md; "
        "choose another --out or move them out of it\n"
    )
    assert (out_dir / "NOTES.md").read_text(encoding="utf-8") == "written meanwhile\n"
    assert verify_shards(out_dir) == earlier
    assert not list(tmp_path.glob(".out.partial-*"))


def test_empty_out_or_input_is_refused(tmp_path: Path, monkeypatch, capsys):
    """An unset shell variable must not mean the current directory."""
    good = tmp_path / "good.txt"
    good.write_text("some good text\n", encoding="utf-8")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    code, _, stderr = run_cli([str(good), "--out", ""], capsys)
    assert code == 2
    assert stderr == "error: --out is empty (an unset variable?): give the output directory\n"
    code, _, stderr = run_cli(["", "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert stderr == "error: an INPUT is empty (an unset variable?): give files or directories\n"
    assert not list(here.iterdir()) and not (tmp_path / "out").exists()


def test_stdlib_corpus_enumerator():
    files = stdlib_source_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 300
    assert files == sorted(files, key=lambda path: path.relative_to(root).parts)
    assert all(path.suffix == ".py" for path in files)
    for path in files:
        parts = set(path.relative_to(root).parts[:-1])
        assert not parts & {"site-packages", "test", "tests", "idlelib", "lib2to3"}, path
        assert path.stat().st_size <= 1 << 20
    relative = {path.relative_to(root).as_posix() for path in files}
    assert {"os.py", "json/decoder.py", "asyncio/events.py"} <= relative


def test_default_stdlib_cache_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = prep.default_stdlib_cache_dir(4096)
    assert path.parent == tmp_path / "eqxzoo"
    assert path.name.startswith("stdlib-3.") and path.name.endswith("-v4096")


def test_interrupted_run_leaves_earlier_output_intact(tmp_path: Path, monkeypatch):
    files = write_text_files(tmp_path / "corpus", make_documents(10))
    out_dir = tmp_path / "out"
    earlier = prepare(files, out_dir).manifest

    def interrupt(self: ShardWriter, token_ids: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(ShardWriter, "write", interrupt)
        with pytest.raises(KeyboardInterrupt):
            prepare(files, out_dir, val_fraction=0.5)
    assert verify_shards(out_dir) == earlier  # the old output is untouched
    assert not list(tmp_path.glob(".out.partial-*"))
    assert prepare(files, out_dir, val_fraction=0.5).manifest.options["val_fraction"] == 0.5


def test_unwritable_out_is_one_line(tmp_path: Path, capsys):
    good = tmp_path / "good.txt"
    good.write_text("some good text\n", encoding="utf-8")
    code, _, stderr = run_cli([str(good), "--out", str(good)], capsys)
    assert code == 2 and "exists and is not a directory" in stderr
    code, _, stderr = run_cli([str(good), "--out", str(good / "out")], capsys)
    assert (
        code == 2 and stderr.startswith("error: cannot write --out") and "Traceback" not in stderr
    )


# ----------------------------------------------------------------------------- chat data

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# name: (special tokens, template, tokenizer_config.json's other keys, an assistant turn's end)
TEMPLATES = {
    "chatml": (
        [EOD_TOKEN, "<|im_start|>", "<|im_end|>"],
        CHATML,
        {"eos_token": "<|im_end|>"},
        "<|im_end|>\n",
    ),
    "llama3": (  # no <|endoftext|>: the end of a document is the checkpoint's eos_token
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        LLAMA3,
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>"},
        },
        "<|eot_id|>",
    ),
}
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what does the model read"},
    {"role": "assistant", "content": "tokens from shards"},
    {"role": "user", "content": "and then"},
    {"role": "assistant", "content": "it learns to predict the next one"},
]


def checkpoint_tokenizer(directory: Path, template: str | None = "chatml") -> Path:
    """A Hugging Face checkpoint's tokenizer files: a small byte-level BPE with the
    template's special tokens, and a ``tokenizer_config.json`` (with the chat template
    unless ``template`` is None)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials, chat_template, config, _ = TEMPLATES[template or "chatml"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(make_documents(40), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    if template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def write_jsonl(path: Path, records: list[object]) -> Path:
    lines = [record if isinstance(record, str) else json.dumps(record) for record in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def marked_split(out_dir: Path, split: str = "train") -> list[np.ndarray]:
    from eqxzoo.data.manifest import decode_marked_record

    manifest = read_manifest(out_dir)
    records = []
    for shard in manifest.splits[split].shards:
        reader = ArrayRecordReader(str(out_dir / shard.file))
        records.extend(decode_marked_record(record) for record in reader.read_all())
        reader.close()
    return records


def target_texts(out_dir: Path, marked: np.ndarray) -> tuple[str, str]:
    """The text of a record's target tokens (joined) and of the whole record."""
    from eqxzoo.data.manifest import is_target, token_ids

    tokenizer = prep.load_tokenizer(out_dir / "tokenizer.json")
    ids, targets = token_ids(marked).tolist(), is_target(marked)
    pieces = [decode_document(tokenizer, [i]) for i in ids]
    return "".join(p for p, t in zip(pieces, targets) if t), decode_document(tokenizer, ids)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_chat_records_target_the_assistant_turns(tmp_path: Path, template: str):
    """Rendered with the checkpoint's template as transformers renders it; the targets are
    the assistant turns with their end-of-turn markers, nothing else."""
    import transformers

    checkpoint = checkpoint_tokenizer(tmp_path / "ckpt", template)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    options = {"tokenizer_file": checkpoint, "val_fraction": 0.0}
    manifest = prep.prepare_corpus(
        [chat], tmp_path / "out", prep.PrepareOptions(**options)
    ).manifest

    (marked,) = marked_split(tmp_path / "out")
    targets, text = target_texts(tmp_path / "out", marked)
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert text == reference.apply_chat_template(CONVERSATION, tokenize=False)
    end = TEMPLATES[template][3]
    assert targets == f"tokens from shards{end}it learns to predict the next one{end}"
    assert manifest.format_version == 2 and manifest.document_formats == ("chat",)
    eod = {"chatml": EOD_TOKEN, "llama3": "<|eot_id|>"}[template]
    assert manifest.tokenizer.eod_token == eod
    assert manifest.tokenizer.vocab_size == reference.backend_tokenizer.get_vocab_size()

    everything = prep.PrepareOptions(**options, train_on="all")
    prep.prepare_corpus([chat], tmp_path / "all", everything)
    (marked,) = marked_split(tmp_path / "all")
    assert target_texts(tmp_path / "all", marked) == (text, text)


def test_prompt_completion_targets_the_completion_and_the_eos(tmp_path: Path):
    checkpoint = checkpoint_tokenizer(tmp_path / "ckpt")
    data = write_jsonl(
        tmp_path / "pairs.jsonl",
        [{"prompt": "the model reads", "completion": " tokens from shards"}],
    )
    options = prep.PrepareOptions(tokenizer_file=checkpoint, val_fraction=0.0)
    manifest = prep.prepare_corpus([data], tmp_path / "out", options).manifest
    (marked,) = marked_split(tmp_path / "out")
    assert target_texts(tmp_path / "out", marked) == (
        " tokens from shards<|im_end|>",
        "the model reads tokens from shards<|im_end|>",
    )
    assert manifest.document_formats == ("prompt_completion",)


CHAT_FILE = [
    {"messages": CONVERSATION},
    "{not json",
    {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
    {"messages": "hello"},
    {"messages": [{"role": "user", "content": "a question nobody answers"}]},
    {"messages": CONVERSATION[1:3]},
    {"messages": CONVERSATION * 3},
]


def test_bad_records_are_reported_with_their_line_and_skipped(tmp_path: Path, capsys):
    checkpoint = checkpoint_tokenizer(tmp_path / "ckpt")
    chat = write_jsonl(tmp_path / "chat.jsonl", CHAT_FILE)
    argv = [str(chat), "--out", str(tmp_path / "out"), "--tokenizer", str(checkpoint)]
    code, stdout, stderr = run_cli([*argv, "--max-tokens", "120", "--val-fraction", "0"], capsys)
    assert code == 0
    *lines, overlong = stderr.splitlines()
    assert lines == [
        f"skipped {chat}:2: not valid JSON (Expecting property name enclosed in double quotes)",
        f"skipped {chat}:3: messages[1]: unknown role 'robot' (this template takes system, "
        "user or assistant)",
        f"skipped {chat}:4: messages[1]: no field 'content'",
        f"skipped {chat}:5: field 'messages' is str, not a list of messages",
        f"skipped {chat}:6: no target token (no assistant turn)",
    ]
    assert re.fullmatch(
        rf"skipped {re.escape(str(chat))}:8: \d{{3}} tokens, more than --max-tokens 120 "
        r"\(--overlong truncate keeps the first ones\)",
        overlong,
    )
    assert (
        "  skipped 6 records: 2 missing or ill-typed field, 1 longer than --max-tokens, "
        "1 malformed JSON, 1 no target token, 1 unknown role\n"
    ) in stdout
    assert "train: 2 documents" in stdout and "formats: chat" in stdout

    code, _, stderr = run_cli([*argv, "--max-tokens", "2", "--overlong", "truncate"], capsys)
    assert code == 2
    assert stderr.splitlines()[-1] == (
        "error: no usable documents: every record was skipped (4 no target token, 2 missing "
        "or ill-typed field, 1 malformed JSON, 1 unknown role)"
    )
    assert f"skipped {chat}:1: no target token (none left after the cut)" in stderr


def test_truncation_keeps_the_start_and_the_cut_end_is_no_target(tmp_path: Path):
    from eqxzoo.data.manifest import is_target

    checkpoint = checkpoint_tokenizer(tmp_path / "ckpt")
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    whole = prep.PrepareOptions(tokenizer_file=checkpoint, val_fraction=0.0)
    prep.prepare_corpus([chat], tmp_path / "whole", whole)
    (full,) = marked_split(tmp_path / "whole")
    cut_at = int(np.flatnonzero(is_target(full))[3]) + 1  # inside the first answer
    cut = dataclasses.replace(whole, max_tokens=cut_at, overlong="truncate")
    prep.prepare_corpus([chat], tmp_path / "cut", cut)
    (kept,) = marked_split(tmp_path / "cut")
    assert len(kept) == cut_at
    np.testing.assert_array_equal(kept[:-1], full[: cut_at - 1])
    assert is_target(full[cut_at - 1 : cut_at])[0] and not is_target(kept[-1:])[0]


def test_formats_are_detected_per_file_or_forced(tmp_path: Path, capsys):
    checkpoint = checkpoint_tokenizer(tmp_path / "ckpt")
    files = [
        write_jsonl(tmp_path / "a.jsonl", [{"messages": CONVERSATION}]),
        write_jsonl(tmp_path / "b.jsonl", [{"prompt": "say ", "completion": "yes"}]),
        write_jsonl(tmp_path / "c.jsonl", [{"text": "plain text"}]),
        *write_text_files(tmp_path / "text", ["a text file\n"]),
    ]
    options = prep.PrepareOptions(tokenizer_file=checkpoint, val_fraction=0.0)
    manifest = prep.prepare_corpus(files, tmp_path / "out", options).manifest
    assert manifest.document_formats == ("chat", "prompt_completion", "text")
    assert manifest.splits["train"].documents == 4
    argv = [str(files[0]), "--out", str(tmp_path / "forced"), "--tokenizer", str(checkpoint)]
    code, _, stderr = run_cli([*argv, "--format", "text"], capsys)
    assert code == 2 and re.search(r"a.jsonl:1: no field 'text' \(set --text-field", stderr)


def test_instruction_options_are_recorded_only_when_set(tmp_path: Path, capsys):
    """Plain text records the options it always did (directories prepared before chat
    data existed stay up to date); a changed instruction option re-prepares."""
    files = write_text_files(tmp_path / "corpus", make_documents(8))
    manifest = prepare(files, tmp_path / "text").manifest
    assert set(manifest.options) == {"tokenizer", "text_field", "val_fraction", "records_per_shard"}
    assert manifest.format_version == 1 and manifest.document_formats == ("text",)

    checkpoint = checkpoint_tokenizer(tmp_path / "ckpt")
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 2)
    argv = [str(chat), "--out", str(tmp_path / "out"), "--tokenizer", str(checkpoint)]
    assert run_cli(argv, capsys)[0] == 0
    assert "instructions" not in read_manifest(tmp_path / "out").options
    assert "up to date" in run_cli(argv, capsys)[1]
    code, stdout, _ = run_cli([*argv, "--train-on", "all"], capsys)
    assert code == 0 and "up to date" not in stdout
    assert read_manifest(tmp_path / "out").options["instructions"]["train_on"] == "all"
    config = checkpoint / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<|im_end|>\\n{% endfor", "{% endfor"))
    assert "up to date" not in run_cli([*argv, "--train-on", "all"], capsys)[1]


NO_TEMPLATE = {
    "trained tokenizer": (
        lambda ckpt: [],
        r"chat.jsonl: chat records are rendered with the model's chat template: give "
        r"--tokenizer the Hugging Face checkpoint directory whose tokenizer_config.json has "
        r"a chat_template$",
    ),
    "bare tokenizer.json": (
        lambda ckpt: ["--tokenizer", str(ckpt / "tokenizer.json")],
        r"chat.jsonl: chat records need a chat template, and --tokenizer .*tokenizer.json is "
        r"a bare tokenizer.json: give --tokenizer the checkpoint directory whose "
        r"tokenizer_config.json has a chat_template$",
    ),
    "directory without one": (
        lambda ckpt: ["--tokenizer", str(ckpt)],
        r"chat.jsonl: chat records need a chat template, and .*ckpt has none: add a "
        r"chat_template to its tokenizer_config.json \(or prepare the records as "
        r"prompt-completion\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(NO_TEMPLATE))
def test_chat_without_a_template_is_one_line(tmp_path: Path, capsys, case: str):
    checkpoint = checkpoint_tokenizer(tmp_path / "ckpt", template=None)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    make_args, message = NO_TEMPLATE[case]
    code, _, stderr = run_cli(
        [str(chat), "--out", str(tmp_path / "out"), *make_args(checkpoint)], capsys
    )
    assert code == 2 and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert re.search(message, stderr.strip()), stderr


def test_instruction_data_bad_options_and_tokenizers_are_one_line(tmp_path: Path, capsys):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "say ", "completion": "yes"}])
    out = ["--out", str(tmp_path / "out")]
    checkpoint = checkpoint_tokenizer(tmp_path / "ckpt", "llama3")
    config = checkpoint / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": LLAMA3}), encoding="utf-8")
    (tmp_path / "empty").mkdir()
    cases = [
        (
            [str(pairs), *out],
            r"pairs.jsonl: prompt-completion records are tokenized by the "
            r"model's own tokenizer: give --tokenizer its Hugging Face checkpoint directory",
        ),
        (
            [str(pairs), *out, "--tokenizer", str(tmp_path / "empty")],
            r"tokenizer directory .*empty has no tokenizer.json",
        ),
        (
            [str(pairs), *out, "--tokenizer", str(checkpoint)],
            r"tokenizer .*ckpt has no <\|endoftext\|> token and its tokenizer_config.json names "
            r"no eos_token it has: set eos_token there",
        ),
        (
            [str(pairs), *out, "--tokenizer", str(checkpoint), "--max-tokens", "0"],
            r"--max-tokens must be >= 1, got 0",
        ),
    ]
    for argv, message in cases:
        code, _, stderr = run_cli(argv, capsys)
        assert code == 2 and stderr.count("\n") == 1 and re.search(message, stderr), stderr
