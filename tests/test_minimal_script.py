"""docs/examples/cleanba_a2c_minimal.py, the complete example of docs/writing_a_script.md: it runs
to its end as a user runs it, a run stopped by SIGTERM resumes from the checkpoint the stop saved,
and the page's call sequence and quoted code are the script's."""

import ast
import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, fingerprint_of
from preempt import assert_resumed_as_uninterrupted
from test_options import UNCHECKED_NUMBERS, number_types

from cleanba_utils import parsing

SCRIPT = REPO / "docs" / "examples" / "cleanba_a2c_minimal.py"
PAGE = REPO / "docs" / "writing_a_script.md"
# 4 environments x 8 steps per update, 4 updates.
TINY = ["--local-num-envs", 4, "--num-steps", 8, "--hiddens", 16, "--total-timesteps", 128]
TINY += ["--log-frequency", 1, "--eval-episodes", 2]

# Runs the minimal script's `main` in this process (tests/preempt.py): run "reference", a copy of
# the uninterrupted run with its newest checkpoint removed, resumed from update 3; then run
# "stopped", checkpointed after update 2, stopped by SIGTERM during update 3 and resumed.
DRIVER = """
import importlib.util
import sys

sys.path.insert(0, sys.argv[1])
from preempt import run_command

spec = importlib.util.spec_from_file_location("cleanba_a2c_minimal", sys.argv[2])
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
argv = sys.argv[3:]
run_command(script, dict(argv=[*argv, "--resume"], name="reference"))
stopped = [*argv, "--checkpoint-every", "2"]
run_command(script, dict(argv=stopped, name="stopped", preempted_after=3))
"""


def load_script():
    spec = importlib.util.spec_from_file_location("cleanba_a2c_minimal", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The script run to its end from the command line, a checkpoint after every update."""
    cwd = tmp_path_factory.mktemp("minimal")
    args = [*TINY, "--checkpoint-every", 1, "--run-name", "whole"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd, result


def test_the_minimal_script_runs_to_its_end(whole):
    cwd, result = whole
    summary = json.loads((cwd / "runs" / "whole" / "summary.json").read_text())
    assert summary["global_step"] == 128 and summary["learner_policy_version"] == 4
    assert summary["params_fingerprint"] == fingerprint_of(result)
    assert len(summary["eval_returns"]) == 1


def test_a_stopped_run_resumes_from_the_checkpoint_the_uninterrupted_run_made(whole, tmp_path):
    # A resumed run of a "restart_lag" script makes its environments anew from the run's seeds, so
    # it is compared with the uninterrupted run resumed from its own checkpoint of the same update:
    # the stop saved that state exactly, and the two resumed runs end with the same parameters.
    cwd, _ = whole
    shutil.copytree(cwd / "runs" / "whole", tmp_path / "runs" / "reference")
    (tmp_path / "runs" / "reference" / "checkpoints" / "update_000000004.ckpt").unlink()
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(REPO / "tests"), str(SCRIPT), *map(str, TINY)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming reference from update 3" in result.stdout
    assert_resumed_as_uninterrupted(tmp_path / "runs", result.stdout, "stopped", "reference", 3)


def section(text: str, heading: str) -> str:
    """The part of a Markdown page under `## heading`, up to the next heading of that level."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def imported_from(source: str, module: str) -> set[str]:
    """The names the script imports from `cleanba_utils.<module>`."""
    return {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module == f"cleanba_utils.{module}"
        for alias in node.names
    }


def is_called(source: str, call: str) -> bool:
    """Whether the script calls `call` as the page writes it: `run.name` on its run, `module.name`
    through the module or a name imported from `cleanba_utils.module`, `name` by that name."""
    prefix, _, name = call.rpartition(".")
    if not prefix or prefix == "run":
        return re.search(rf"(?<![\w.]){re.escape(call)}\(", source) is not None
    used = len(re.findall(rf"(?<![\w.]){name}\b", source)) > 1
    return f"{prefix}.{name}(" in source or (name in imported_from(source, prefix) and used)


def test_every_call_of_the_pages_sequence_is_in_the_minimal_script():
    sequence = section(PAGE.read_text(), "The sequence of calls")
    calls = set(re.findall(r"`([A-Za-z_][\w.]*)\(", sequence))
    expected = {"open_run", "run.learner_loop", "handoff.take_rollouts", "run.after_update"}
    assert expected <= calls, expected - calls
    source = SCRIPT.read_text()
    assert not [call for call in sorted(calls) if not is_called(source, call)]


def test_the_code_the_page_quotes_is_the_minimal_scripts():
    quoted = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.M | re.S)
    assert quoted
    script_lines = [line.strip() for line in SCRIPT.read_text().splitlines()]
    for block in quoted:
        lines = [line.strip() for line in block.splitlines()]
        starts = range(len(script_lines) - len(lines) + 1)
        assert any(script_lines[i : i + len(lines)] == lines for i in starts), block


def test_every_numeric_option_declares_its_check_or_says_what_checks_it():
    for field in dataclasses.fields(load_script().Args):
        if number_types(field.type) and field.name not in UNCHECKED_NUMBERS:
            assert parsing.CHECK in field.metadata, f"--{field.name} declares no check"
