"""Options that declare their own check on their dataclass field (`positive`, `non_negative`,
`in_range`, `at_most`; `parsing.check_fields` applies them), and what an option needs to act
(`Need`; `parsing.check_needs`). Imports nothing of the package: `run_args` and the scripts' `Args`
build on it."""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

CHECK = "check"
"""The key of a field's `Check` in its metadata (tyro reads only the key "help" there)."""


class Check(NamedTuple):
    """What an option's value must satisfy: `holds(value)`, and `requirement`, the message's words
    where it does not ("must be positive")."""

    holds: Callable[[Any], bool]
    requirement: str


def checked(default, check: Check):
    """A dataclass field with `default` whose option `check_fields` checks; None, where the default
    is None, stands for the option left unset and is not checked."""
    return dataclasses.field(default=default, metadata={CHECK: check})


def positive(default):
    """A field whose value must be above 0."""
    return checked(default, Check(lambda value: value > 0, "must be positive"))


def non_negative(default):
    """A field whose value must be 0 or above."""
    return checked(default, Check(lambda value: value >= 0, "must be non-negative"))


def in_range(default, low: float, high: float, low_open: bool = False):
    """A field whose value must lie in [low, high], or in (low, high] with `low_open`."""

    def holds(value) -> bool:
        return low < value <= high if low_open else low <= value <= high

    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    return checked(default, Check(holds, f"must be in {interval}"))


def at_most(default, high: float):
    """A field whose value must be `high` or below."""
    return checked(default, Check(lambda value: value <= high, f"must be at most {high:g}"))


class Need(NamedTuple):
    """What an option needs to act: `holds(args)` says whether it acts in the configuration `args`
    chose, `what` names the options (or the task) that make it act."""

    holds: Callable[[Any], bool]
    what: str
