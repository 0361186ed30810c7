"""What the command lines of the experiment tools share: warnings, argument types, and argparse's
errors as one line."""

import argparse
import sys

from cleanba_utils.errors import fail


def warn(message: str, prog: str):
    print(f"{prog}: warning: {message}", file=sys.stderr)


def info(message: str, prog: str):
    """What a tool tells besides its output, on stderr."""
    print(f"{prog}: {message}", file=sys.stderr)


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def one_line_errors(parser: argparse.ArgumentParser, prog: str):
    """argparse prints its whole usage block before an error; keep only the error."""
    parser.error = lambda message: fail(f"{message} (see `{parser.prog} --help`)", prog=prog)
