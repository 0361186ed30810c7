"""`.ci/check_machine.py`: each requirement that CI's tests have of the machine, missing, is one
line naming it and how to provide it, and exit 2; all present, nothing and exit 0."""

import importlib.util
import subprocess

import pytest
from helpers import REPO


def check_machine():
    spec = importlib.util.spec_from_file_location(
        "check_machine", REPO / ".ci" / "check_machine.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def all_present(module, monkeypatch):
    monkeypatch.setattr(module.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        module.subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(args, 0)
    )
    monkeypatch.setattr(module.huge_pages, "madvised_huge_pages", lambda: True)
    monkeypatch.setattr(module.huge_pages, "glibc_has_the_tunable", lambda: True)


def test_a_machine_with_everything_passes_in_silence(monkeypatch, capsys):
    module = check_machine()
    all_present(module, monkeypatch)
    assert module.main() == 0
    assert capsys.readouterr().err == ""


def refused_mount(*args, **kwargs):
    return subprocess.CompletedProcess(args, 32, stderr="mount: permission denied\n")


@pytest.mark.parametrize(
    "target,attribute,stand_in,named",
    [
        ("os", "geteuid", lambda: 1000, "not root"),
        ("subprocess", "run", refused_mount, "cannot mount a tmpfs (mount: permission denied)"),
        ("huge_pages", "madvised_huge_pages", lambda: False, "echo madvise > /sys/kernel/mm"),
        ("huge_pages", "glibc_has_the_tunable", lambda: False, "glibc is older than 2.35"),
    ],
)
def test_each_missing_requirement_is_one_line_and_exit_2(
    monkeypatch, capsys, target, attribute, stand_in, named
):
    module = check_machine()
    all_present(module, monkeypatch)
    monkeypatch.setattr(getattr(module, target), attribute, stand_in)
    assert module.main() == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and named in lines[0], lines
    assert lines[0].startswith("error: CI needs what this machine lacks: ")
