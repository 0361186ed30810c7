"""What every cleanba_utils command line shares: one-line errors and argument types."""

import argparse
import sys


def fail(prog: str, message: str):
    """A user mistake: one line on stderr, exit code 2, no traceback."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def warn(prog: str, message: str):
    print(f"{prog}: warning: {message}", file=sys.stderr)


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def one_line_errors(parser: argparse.ArgumentParser, prog: str):
    """argparse prints its whole usage block before an error; keep only the error."""
    parser.error = lambda message: fail(prog, f"{message} (see `{parser.prog} --help`)")
