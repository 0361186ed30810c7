"""A user's mistake, in the scripts and in the experiment tools alike: one line on stderr and exit
code 2. Imports nothing of the package, so that every module can use it."""

import sys
from typing import NoReturn


def fail(message: str, prog: str | None = None) -> NoReturn:
    """A user's mistake: `error: message` on stderr (`prog: error: message` for a named command-line
    tool), exit code 2, no traceback."""
    prefix = f"{prog}: error" if prog else "error"
    print(f"{prefix}: {message}", file=sys.stderr)
    sys.exit(2)
