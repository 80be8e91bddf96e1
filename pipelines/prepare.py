"""Prepare a training corpus: raw text -> tokenizer.json, ArrayRecord shards and manifest.json.

    python -m pipelines.prepare INPUT ... --out DIR [--vocab-size N | --tokenizer FILE_OR_DIR]
        [--text-field text] [--val-fraction 0.01] [--records-per-shard 4096]
        [--format auto|text|chat|prompt_completion] [--train-on completion|all]
        [--max-tokens N] [--overlong drop|truncate]
    python -m pipelines.prepare --stdlib --out DIR --vocab-size 4096

INPUTs are UTF-8 text files (one document each), JSONL files (``.jsonl``, one document per
line) or directories walked recursively in sorted order; any of them may be gzipped
(``.gz``). ``--stdlib`` adds the built-in corpus: this Python's standard-library sources.
A JSONL file holds plain text under ``--text-field``, or TRL's chat records
(``{"messages": [{"role", "content"}, ...]}``, rendered with the chat template of the
``--tokenizer`` checkpoint directory) or prompt-completion records (``{"prompt",
"completion"}``); each file's first record tells which, unless ``--format`` says. Of chat and
prompt-completion records only the assistant turns and completions are targets unless
``--train-on all``; ``--max-tokens`` drops (or with ``--overlong truncate`` cuts) longer
ones. Such a record that cannot be used is reported (``file.jsonl:17: ...`` on stderr) and
skipped, with a count per reason at the end; the exit code is 0 as long as some document
was prepared. Re-running with unchanged inputs and options prints "up to date";
with changed ones it replaces DIR, but only while DIR holds nothing but earlier outputs of
this command: anything else in it is named and refused, and nothing is touched. An empty
``--out`` or INPUT (an unset shell variable) is refused rather than taken as the current
directory. Bad input is one ``error:`` line on stderr and exit code 2.
"""

import argparse
import io
import sys
from pathlib import Path

from rich.status import Status
from rich.text import Text

from eqxzoo.data.instructions import OVERLONG, TRAIN_ON
from eqxzoo.data.manifest import DOCUMENT_FORMATS
from eqxzoo.data.prepare import (
    AUTO_FORMAT,
    DataError,
    PrepareOptions,
    PrepareResult,
    describe_counts,
    prepare_corpus,
)
from eqxzoo.data.sources import RecordProblem
from eqxzoo.data.tokenizer import DEFAULT_VOCAB_SIZE
from eqxzoo.errors import EXIT_OK, run_command
from eqxzoo.progress import terminal_console
from pipelines.cli import absolute_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.prepare",
        description="Tokenise text into ArrayRecord training shards.",
    )
    parser.add_argument("inputs", nargs="*", help="text/JSONL files or directories")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--stdlib", action="store_true", help="add the Python standard library's sources"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"train a byte-level BPE of this many tokens (default {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="use this tokenizer.json, or a Hugging Face checkpoint directory's tokenizer "
        "(with its tokenizer_config.json), instead of training one",
    )
    parser.add_argument("--text-field", default="text", help="JSONL field holding the text")
    parser.add_argument(
        "--format",
        choices=(AUTO_FORMAT, *DOCUMENT_FORMATS),
        default=AUTO_FORMAT,
        help="the records of every JSONL file (default: each file's first record tells)",
    )
    parser.add_argument(
        "--train-on",
        choices=TRAIN_ON,
        default="completion",
        help="targets of chat / prompt-completion records: assistant turns and completions "
        "(default), or all tokens",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="chat / prompt-completion records longer than this are dropped (default: no limit)",
    )
    parser.add_argument(
        "--overlong",
        choices=OVERLONG,
        default="drop",
        help="what --max-tokens does to a longer record: drop it (default) or keep its start",
    )
    parser.add_argument("--val-fraction", type=float, default=0.01, help="validation share")
    parser.add_argument(
        "--records-per-shard", type=int, default=4096, help="documents per shard at most"
    )
    return parser.parse_args(argv)


def options_from_args(args: argparse.Namespace) -> PrepareOptions:
    if args.tokenizer is not None and args.vocab_size is not None:
        raise DataError("give either --tokenizer or --vocab-size, not both")
    return PrepareOptions(
        vocab_size=DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
        tokenizer_file=None if args.tokenizer is None else absolute_path(args.tokenizer),
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        records_per_shard=args.records_per_shard,
        document_format=args.format,
        train_on=args.train_on,
        max_tokens=args.max_tokens,
        overlong=args.overlong,
    )


PROBLEMS_SHOWN = 20


class ProblemReport:
    """Prints each skipped record as ``skipped file.jsonl:17: why`` on ``stream``, the first
    `PROBLEMS_SHOWN` of them; the counts at the end cover the rest."""

    def __init__(self, stream: io.TextIOBase):
        self.stream = stream
        self.seen = 0

    def __call__(self, problem: RecordProblem) -> None:
        self.seen += 1
        if self.seen <= PROBLEMS_SHOWN:
            print(f"skipped {problem}", file=self.stream, flush=True)
        elif self.seen == PROBLEMS_SHOWN + 1:
            print("skipped more records (counted below)", file=self.stream, flush=True)


class PhaseProgress:
    """Shows the phases of `prepare_corpus` as they start; pass it as ``progress=``.

    On a terminal the current phase has a spinner until the next one starts, then stays as a
    line; elsewhere each phase is one line printed when it starts: the same text either way.
    Use it as a context manager, so that the spinner stops however the preparation ends.
    """

    def __init__(self, stream: io.TextIOBase):
        self.stream = stream
        self.console = terminal_console(stream)
        self._status: Status | None = None
        self._phase = ""

    def __call__(self, phase: str) -> None:
        if self.console is None:
            print(phase, file=self.stream, flush=True)
            return
        if self._status is None:
            self._status = self.console.status(Text(phase))
            self._status.start()
        else:
            self.console.print(self._phase)
            self._status.update(Text(phase))
        self._phase = phase

    def close(self) -> None:
        """Stop the spinner, leaving the last phase as a line; safe to call again."""
        if self._status is not None:
            self._status.stop()
            self._status = None
            self.console.print(self._phase)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def describe(result: PrepareResult) -> str:
    """The summary printed after a run: where, how long, and what each split holds."""
    manifest = result.manifest
    if result.up_to_date:
        lines = [f"{result.out_dir}: up to date"]
    else:
        lines = [
            f"prepared {result.out_dir} in {result.total_seconds:.1f} s "
            f"(tokenizer {result.tokenizer_seconds:.1f} s)"
        ]
        if result.skipped_files:
            lines.append(f"  skipped {len(result.skipped_files)} files that are not UTF-8 text")
        if result.skipped_records:
            skipped = sum(result.skipped_records.values())
            records = "record" if skipped == 1 else "records"
            counts = describe_counts(result.skipped_records)
            lines.append(f"  skipped {skipped} {records}: {counts}")
    tokenizer = manifest.tokenizer
    lines.append(
        f"  tokenizer: vocab {tokenizer.vocab_size}, eod {tokenizer.eod_token} "
        f"(id {tokenizer.eod_token_id})"
    )
    lines.append(f"  formats: {', '.join(manifest.document_formats)}")
    for name, split in manifest.splits.items():
        lines.append(
            f"  {name}: {split.documents} documents, {split.tokens} tokens, "
            f"{len(split.shards)} shards"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: prepare(args))


def prepare(args: argparse.Namespace) -> int:
    if not args.inputs and not args.stdlib:
        raise DataError("no inputs: give files or directories, or --stdlib")
    if not all(args.inputs):
        raise DataError("an INPUT is empty (an unset variable?): give files or directories")
    if not args.out:
        raise DataError("--out is empty (an unset variable?): give the output directory")
    with PhaseProgress(sys.stdout) as progress:
        result = prepare_corpus(
            [absolute_path(path) for path in args.inputs],
            absolute_path(args.out),
            options_from_args(args),
            include_stdlib=args.stdlib,
            progress=progress,
            report=ProblemReport(sys.stderr),
        )
    print(describe(result))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
