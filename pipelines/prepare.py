"""Prepare a training corpus: raw text -> tokenizer.json, ArrayRecord shards and manifest.json.

    python -m pipelines.prepare INPUT ... --out DIR [--vocab-size N | --tokenizer FILE]
        [--text-field text] [--val-fraction 0.01] [--records-per-shard 4096]
    python -m pipelines.prepare --stdlib --out DIR --vocab-size 4096

INPUTs are UTF-8 text files (one document each), JSONL files (``.jsonl``, one document per
line, its text under ``--text-field``) or directories walked recursively in sorted order;
any of them may be gzipped (``.gz``). ``--stdlib`` adds the built-in corpus: this Python's
standard-library sources. Re-running with unchanged inputs and options prints "up to date";
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

from eqxzoo.data.prepare import (
    DataError,
    PrepareOptions,
    PrepareResult,
    prepare_corpus,
)
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
        "--tokenizer", type=Path, help="use this tokenizer.json instead of training one"
    )
    parser.add_argument("--text-field", default="text", help="JSONL field holding the text")
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
    )


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
    tokenizer = manifest.tokenizer
    lines.append(f"  tokenizer: vocab {tokenizer.vocab_size}, eod id {tokenizer.eod_token_id}")
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
        )
    print(describe(result))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
