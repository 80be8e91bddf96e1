"""The grain loader: exact packing, seeded order, mesh/process invariance, resume, bad input."""

import json
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from test_prepare import checkpoint_tokenizer, make_documents, write_jsonl, write_text_files

from eqxzoo.data import loader
from eqxzoo.data import prepare as prep
from eqxzoo.data.manifest import NOT_TARGET, decode_marked_record, decode_record
from eqxzoo.data.prepare import DataError
from eqxzoo.parallel import MeshConfig, make_mesh
from eqxzoo.train.step import batch_sharding

SHAPE = loader.BatchShape(grad_accum=2, microbatches=2, batch_size=4, seq_len=15)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    files = write_text_files(root / "text", make_documents(120))
    options = prep.PrepareOptions(vocab_size=300, val_fraction=0.2, records_per_shard=16)
    return prep.prepare_corpus(files, root / "prepared", options).out_dir


@pytest.fixture(scope="module")
def train_documents(corpus: Path) -> loader.SplitDocuments:
    return loader.open_split(corpus, "train")


def one_device_sharding() -> NamedSharding:
    return batch_sharding(make_mesh(MeshConfig(), devices=jax.devices()[:1]))


def records(documents: loader.SplitDocuments) -> list[np.ndarray]:
    source = documents.source
    return [decode_record(record) for record in source.__getitems__(range(len(source)))]


def take(batches: loader.Batches, count: int) -> np.ndarray:
    """``count`` batches as one ``(count, G, M, B, T + 1)`` array of windows."""
    steps = []
    for _ in range(count):
        batch = next(batches)
        tokens, targets = np.asarray(batch["tokens"]), np.asarray(batch["targets"])
        np.testing.assert_array_equal(tokens[..., 1:], targets[..., :-1])
        steps.append(np.concatenate([tokens, targets[..., -1:]], axis=-1))
    return np.stack(steps)


def train_batches(documents, sharding=None, seed=0, shape=SHAPE) -> loader.Batches:
    sharding = one_device_sharding() if sharding is None else sharding
    return loader.train_batches(documents, shape, sharding, seed=seed, prefetch=2, num_threads=1)


def test_packing_loses_and_repeats_no_token(train_documents: loader.SplitDocuments):
    """Every document once per epoch in the stream, and every window of the stream consumed
    exactly once, in shuffled order."""
    docs = records(train_documents)
    eod = train_documents.eod_token_id
    epoch_tokens = train_documents.stream_tokens
    width = SHAPE.window_tokens
    stream = loader.TokenStream(train_documents, seed=0, shuffle=True).read(0, 2 * epoch_tokens)
    for epoch in range(2):
        tokens = stream[epoch * epoch_tokens : (epoch + 1) * epoch_tokens]
        assert tokens[-1] == eod
        pieces = np.split(tokens, np.flatnonzero(tokens == eod)[:-1] + 1)
        seen = sorted(tuple(piece[:-1].tolist()) for piece in pieces)
        assert seen == sorted(tuple(doc.tolist()) for doc in docs)
        assert np.sum(tokens == eod) == len(docs)
    assert not np.array_equal(stream[:epoch_tokens], stream[epoch_tokens:]), "epochs reshuffle"

    block_windows = epoch_tokens // width
    steps = 2 * block_windows // SHAPE.windows + 1
    batches = train_batches(train_documents)
    consumed = take(batches, steps).reshape(-1, width)[: 2 * block_windows]
    batches.close()
    expected = stream[: 2 * block_windows * width].reshape(-1, width)
    assert sorted(map(tuple, consumed.tolist())) == sorted(map(tuple, expected.tolist()))
    assert not np.array_equal(consumed[:block_windows], expected[:block_windows])


def test_same_seed_same_order_other_seed_other_order(
    train_documents: loader.SplitDocuments,
):
    first, again, other = (train_batches(train_documents, seed=s) for s in (3, 3, 4))
    a, b, c = take(first, 3), take(again, 3), take(other, 3)
    for batches in (first, again, other):
        batches.close()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize(("processes", "split"), [(2, "rows"), (4, "rows"), (3, "columns")])
def test_order_is_the_same_for_any_number_of_processes(
    train_documents: loader.SplitDocuments, processes: int, split: str
):
    """Each simulated process reads only its rows of B (or, with the sequences split over cp
    across processes, its tokens of T); together they are the 1-process batch."""
    stream = loader.TokenStream(train_documents, seed=0, shuffle=True)
    whole = loader.WindowReader(stream, SHAPE, (0, SHAPE.batch_size), first_window=0)
    size = (SHAPE.batch_size if split == "rows" else SHAPE.seq_len) // processes
    parts = [(p * size, (p + 1) * size) for p in range(processes)]
    readers = [
        loader.WindowReader(stream, SHAPE, part, first_window=0)
        if split == "rows"
        else loader.WindowReader(stream, SHAPE, (0, SHAPE.batch_size), 0, columns=part)
        for part in parts
    ]
    for step in (0, 1, 7):
        expected = whole(step)
        pieces = [read(step) for read in readers]
        for name in ("inputs", "targets"):
            assembled = np.concatenate(
                [getattr(piece, name) for piece in pieces], axis=2 if split == "rows" else 3
            )
            np.testing.assert_array_equal(assembled, getattr(expected, name))


@pytest.mark.parametrize(
    "mesh",
    [MeshConfig(dp=2, pp=2, tp=2), MeshConfig(dp=4, pp=2), MeshConfig(dp=2, pp=2, ep=2)],
)
def test_order_is_the_same_on_every_mesh(train_documents: loader.SplitDocuments, mesh):
    """The same batches on every mesh, each device holding its rows: split over dp and ep
    (expert parallelism borrows data parallelism's devices)."""
    reference = train_batches(train_documents)
    sharded = train_batches(train_documents, batch_sharding(make_mesh(mesh)))
    expected = take(reference, 2)
    batch = next(sharded)
    assert batch["tokens"].sharding.spec == PartitionSpec(None, None, ("dp", "ep"), "cp")
    shards = batch["tokens"].addressable_shards
    assert {shard.data.shape[2] for shard in shards} == {SHAPE.batch_size // (mesh.dp * mesh.ep)}
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), expected[0, ..., :-1])
    np.testing.assert_array_equal(take(sharded, 1)[0], expected[1])
    reference.close()
    sharded.close()


def test_process_rows_follow_the_sharding():
    mesh = make_mesh(MeshConfig(dp=4, pp=2))
    assert loader.process_rows(batch_sharding(mesh), SHAPE) == (0, SHAPE.batch_size)
    assert loader.process_columns(batch_sharding(mesh), SHAPE) == (0, SHAPE.seq_len)
    # What a process holding two of three cp shards' devices reads: its tokens of T.
    third = SHAPE.seq_len // 3
    held = [slice(third, 2 * third), slice(2 * third, None)]
    assert loader.held_range(held, SHAPE.seq_len, "tokens") == (third, SHAPE.seq_len)
    with pytest.raises(ValueError, match="not one contiguous range"):
        loader.held_range([slice(0, third), held[1]], SHAPE.seq_len, "tokens")


def test_restore_mid_epoch_continues_with_exactly_the_next_batch(
    train_documents: loader.SplitDocuments, tmp_path: Path
):
    batches = train_batches(train_documents)
    take(batches, 3)
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(tmp_path, args=grain.checkpoint.CheckpointSave(batches))
    expected = take(batches, 4)
    batches.close()

    resumed = train_batches(train_documents)
    take(resumed, 1)  # a fresh iterator that has already moved on is put back in place
    handler.restore(tmp_path, args=grain.checkpoint.CheckpointRestore(resumed))
    np.testing.assert_array_equal(take(resumed, 4), expected)
    assert json.loads(next(tmp_path.glob("process_*.json")).read_text())["next_window"] == (
        3 * SHAPE.windows
    )
    resumed.close()


def test_resume_with_another_batch_size_takes_the_next_unseen_windows(
    train_documents: loader.SplitDocuments,
):
    batches = train_batches(train_documents)
    first = take(batches, 2)
    state = batches.get_state()
    batches.close()
    smaller = loader.BatchShape(grad_accum=1, microbatches=1, batch_size=2, seq_len=15)
    resumed = train_batches(train_documents, shape=smaller)
    resumed.set_state(state)
    continued = take(resumed, 2).reshape(-1)
    resumed.close()
    reference = train_batches(train_documents)
    stream = take(reference, 3).reshape(-1)
    reference.close()
    np.testing.assert_array_equal(stream[: first.size], first.reshape(-1))
    np.testing.assert_array_equal(stream[first.size : first.size + continued.size], continued)


def test_validation_batches_are_a_fixed_set(corpus: Path):
    documents = loader.open_split(corpus, "val")
    sharding = batch_sharding(make_mesh(MeshConfig(dp=2, pp=2, tp=2)))
    shape = loader.BatchShape(grad_accum=1, microbatches=2, batch_size=2, seq_len=15)
    first = loader.validation_batches(documents, shape, sharding, batches=2)
    again = loader.validation_batches(documents, shape, one_device_sharding(), batches=2)
    assert len(first) == 2
    for a, b in zip(first, again):
        for name in ("tokens", "targets"):
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    stream = loader.TokenStream(documents, seed=0, shuffle=True)
    windows = np.asarray(first[1]["tokens"]).reshape(-1, 15)
    for index, window in enumerate(windows, start=shape.windows):
        np.testing.assert_array_equal(window, stream.window(index, 16)[:-1])


# ----------------------------------------------------------------------------- bad input


def copy_corpus(corpus: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    target.mkdir()
    for path in corpus.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def test_tokenizer_larger_than_the_model_vocabulary(
    train_documents: loader.SplitDocuments,
):
    with pytest.raises(DataError, match=r"tokenizer has \d+ tokens but model.vocab_size is 100"):
        loader.check_vocab(train_documents, 100)
    loader.check_vocab(train_documents, train_documents.vocab_size)


def test_truncated_shard_is_reported_by_its_checksum(corpus: Path, tmp_path: Path):
    copy = copy_corpus(corpus, tmp_path)
    shard = copy / "train-00001.array_record"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"shard .*train-00001.array_record is corrupt: sha256"):
        loader.open_split(copy, "train")


def test_manifest_that_does_not_match_the_shards(corpus: Path, tmp_path: Path):
    copy = copy_corpus(corpus, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["records"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DataError,
        match=r"train-00000.array_record does not match the manifest: it holds 16 doc",
    ):
        loader.open_split(copy, "train")


def test_missing_shard(corpus: Path, tmp_path: Path):
    copy = copy_corpus(corpus, tmp_path)
    (copy / "val-00000.array_record").unlink()
    with pytest.raises(DataError, match=r"shard .*val-00000.array_record is missing"):
        loader.open_split(copy, "val", verify=False)


def test_sequence_longer_than_the_split_can_fill(
    train_documents: loader.SplitDocuments,
):
    shape = loader.BatchShape(grad_accum=1, microbatches=1, batch_size=1, seq_len=100_000)
    with pytest.raises(DataError, match=r"data.seq_len 100000: 1 batch\(es\) of 1 sequences need"):
        loader.train_batches(train_documents, shape, one_device_sharding(), seed=0)


def test_restoring_a_position_from_another_stream(
    train_documents: loader.SplitDocuments,
):
    state = train_batches(train_documents, seed=1).get_state()
    with pytest.raises(DataError, match="belongs to another stream"):
        train_batches(train_documents, seed=2).set_state(state)


# ----------------------------------------------------------------------------- chat data

CHAT_SHAPE = loader.BatchShape(grad_accum=1, microbatches=2, batch_size=3, seq_len=40)


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Conversations of one to three turns, some ending with a question (a prompt-completion
    file besides), so windows hold several documents and documents span windows."""
    root = tmp_path_factory.mktemp("chat")
    checkpoint = checkpoint_tokenizer(root / "ckpt")
    texts = make_documents(90, seed=5)
    conversations = []
    for index in range(0, 60, 3):
        turns = texts[index : index + 1 + index % 3]
        messages = [{"role": "system", "content": "be brief"}] if index % 2 else []
        for turn in turns:
            messages += [
                {"role": "user", "content": turn[:12]},
                {"role": "assistant", "content": turn[12:]},
            ]
        if index % 4 == 0:  # ends with a question: its end-of-document is no target
            messages.append({"role": "user", "content": "and then?"})
        conversations.append({"messages": messages})
    pairs = [{"prompt": text[:10], "completion": text[10:]} for text in texts[60:]]
    files = [
        write_jsonl(root / "chat.jsonl", conversations),
        write_jsonl(root / "pairs.jsonl", pairs),
    ]
    options = prep.PrepareOptions(tokenizer_file=checkpoint, val_fraction=0.2)
    return prep.prepare_corpus(files, root / "prepared", options).out_dir


def annotated_stream(
    documents: loader.SplitDocuments, stream: loader.TokenStream, epochs: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stream of ``epochs`` epochs built the plain way, document by document: its marked
    tokens, and each token's document number and that document's start."""
    marked = [
        decode_marked_record(r) for r in documents.source.__getitems__(range(len(documents.source)))
    ]
    pieces, numbers, starts = [], [], []
    offset = 0
    for epoch in range(epochs):
        order, _ = stream._epoch(epoch)
        for index in order:
            document = marked[int(index)]
            last_mark = document[-1] & np.uint32(NOT_TARGET)
            piece = np.append(document, np.uint32(documents.eod_token_id) | last_mark)
            numbers.append(np.full(len(piece), len(pieces)))
            starts.append(np.full(len(piece), offset))
            pieces.append(piece)
            offset += len(piece)
    return np.concatenate(pieces), np.concatenate(numbers), np.concatenate(starts)


def expected_window(stream_arrays, start: int, seq_len: int, document_mask: bool) -> dict:
    """What a window starting at ``start`` holds, by the rules of the loader's module doc."""
    marked, numbers, starts = stream_arrays
    window = slice(start, start + seq_len)
    following = slice(start + 1, start + seq_len + 1)
    ids = (marked & np.uint32(NOT_TARGET - 1)).astype(np.int32)
    is_target = (marked[following] & np.uint32(NOT_TARGET)) == 0
    if document_mask:
        is_target &= numbers[following] == numbers[window]
    expected = {"tokens": ids[window], "targets": np.where(is_target, ids[following], -1)}
    if document_mask:
        expected["segments"] = numbers[window] - numbers[start]
        offsets = np.arange(start, start + seq_len)
        expected["positions"] = offsets - np.maximum(starts[window], start)
    return expected


@pytest.mark.parametrize("document_mask", [None, False])
def test_chat_batches_carry_targets_segments_and_positions(chat_corpus: Path, document_mask):
    """Unset, document masks are on for chat data; off, the targets still skip the prompts."""
    documents = loader.open_split(chat_corpus, "train")
    assert documents.document_formats == ("chat", "prompt_completion")
    batches = loader.train_batches(
        documents,
        CHAT_SHAPE,
        one_device_sharding(),
        seed=1,
        prefetch=1,
        num_threads=1,
        document_mask=document_mask,
    )
    stream = batches.stream
    steps = 3
    epochs = steps * CHAT_SHAPE.windows * CHAT_SHAPE.window_tokens // stream.epoch_tokens + 2
    reference = annotated_stream(documents, stream, epochs)
    masked = document_mask is None
    for step in range(steps):
        batch = {name: np.asarray(array) for name, array in next(batches).items()}
        names = {"tokens", "targets"} | ({"segments", "positions"} if masked else set())
        assert set(batch) == names
        windows = {name: array.reshape(-1, CHAT_SHAPE.seq_len) for name, array in batch.items()}
        for row in range(CHAT_SHAPE.windows):
            start = stream.window_start(step * CHAT_SHAPE.windows + row, CHAT_SHAPE.window_tokens)
            expected = expected_window(reference, start, CHAT_SHAPE.seq_len, masked)
            for name, values in expected.items():
                np.testing.assert_array_equal(windows[name][row], values, err_msg=name)
    batches.close()
    targets = windows["targets"]
    assert (targets == -1).any() and (targets >= 0).any()
    if masked:
        assert (windows["segments"].max(axis=1) > 0).any(), "some window holds two documents"


def test_segments_do_not_depend_on_the_columns_a_process_reads(chat_corpus: Path):
    """Under context parallelism a process reads some columns of each window: the segment
    ids, positions and targets of its columns are those of the whole window."""
    documents = loader.open_split(chat_corpus, "train", verify=False)
    stream = loader.TokenStream(documents, seed=0, shuffle=True)
    rows = (0, CHAT_SHAPE.batch_size)
    whole = loader.WindowReader(stream, CHAT_SHAPE, rows, 0, document_mask=True)
    parts = [(0, 13), (13, 27), (27, 40)]
    readers = [
        loader.WindowReader(stream, CHAT_SHAPE, rows, 0, part, document_mask=True) for part in parts
    ]
    for step in (0, 5):
        expected = whole(step).arrays()
        pieces = [read(step).arrays() for read in readers]
        for name, array in expected.items():
            np.testing.assert_array_equal(np.concatenate([p[name] for p in pieces], axis=3), array)


def test_plain_text_is_packed_as_before_unless_masks_are_asked(train_documents, corpus: Path):
    """Plain text: no segments by default (today's batches); with masks, the same tokens and
    targets except that an end-of-document token's target is ignored."""
    plain = train_batches(train_documents)
    masked = loader.train_batches(
        train_documents,
        SHAPE,
        one_device_sharding(),
        seed=0,
        prefetch=1,
        num_threads=1,
        document_mask=True,
    )
    for _ in range(2):
        before, after = next(plain), next(masked)
        assert set(before) == {"tokens", "targets"}
        tokens, targets = np.asarray(after["tokens"]), np.asarray(after["targets"])
        np.testing.assert_array_equal(tokens, np.asarray(before["tokens"]))
        at_eod = tokens == train_documents.eod_token_id
        np.testing.assert_array_equal(targets[~at_eod], np.asarray(before["targets"])[~at_eod])
        assert (targets[at_eod] == -1).all() and at_eod.any()
        assert (np.asarray(after["targets"]) >= 0).sum() > 0.8 * targets.size
    plain.close()
    masked.close()
    documents = loader.open_split(corpus, "val")
    shape = loader.BatchShape(grad_accum=1, microbatches=1, batch_size=2, seq_len=15)
    (batch,) = loader.validation_batches(
        documents, shape, one_device_sharding(), batches=1, document_mask=True
    )
    assert set(batch) == {"tokens", "targets", "segments", "positions"}
    assert batch["segments"].sharding == batch["tokens"].sharding


def test_validation_batches_of_chat_data_carry_the_masks(chat_corpus: Path):
    documents = loader.open_split(chat_corpus, "val")
    shape = loader.BatchShape(grad_accum=1, microbatches=1, batch_size=2, seq_len=20)
    sharding = batch_sharding(make_mesh(MeshConfig(dp=2, pp=2, tp=2)))
    (batch,) = loader.validation_batches(documents, shape, sharding, batches=1)
    assert set(batch) == {"tokens", "targets", "segments", "positions"}
    stream = loader.TokenStream(documents, seed=0, shuffle=True)
    reference = annotated_stream(documents, stream, 2)
    for row in range(2):
        expected = expected_window(reference, stream.window_start(row, 21), 20, True)
        for name, values in expected.items():
            np.testing.assert_array_equal(np.asarray(batch[name])[0, 0, row], values)


def test_the_ignored_target_is_the_trainers():
    from eqxzoo.train.loss import IGNORED

    assert loader.IGNORED == IGNORED


def test_a_manifest_from_before_formats_reads_as_plain_text(corpus: Path, tmp_path: Path):
    copy = copy_corpus(corpus, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["document_formats"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    documents = loader.open_split(copy, "train")
    assert documents.document_formats == ("text",) and not documents.document_mask(None)
    manifest["format_version"] = 3
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"manifest format 3 is not one of 1, 2; re-run"):
        loader.open_split(copy, "train")
