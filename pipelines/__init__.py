"""Entry points: run (train), prepare (data), generate, convert, bench."""
