"""docs/examples/cleanba_a2c_minimal.py, the complete example of docs/writing_a_script.md: it runs
to its end as a user runs it and, at its defaults, learns CartPole within a minute; a run stopped by
SIGTERM saves the uninterrupted run's state and resumes from it; the page's call sequence (its
calls, in its order) and quoted code are the script's."""

import ast
import dataclasses
import hashlib
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import time

import flax.serialization
import numpy as np
import pytest
from helpers import REPO, fingerprint_of, scalars
from preempt import assert_resumed_as_uninterrupted
from test_options import UNCHECKED_NUMBERS, number_types

from cleanba_utils import fields

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
    # What the stop saved is the uninterrupted run's state after the same update: every array of
    # the checkpoints, bit for bit, and the counters (but the wall time, and the options of the
    # run's name and checkpoint cadence, which the two runs set apart).
    name = "checkpoints/update_000000003.ckpt"
    stopped = checkpoint_contents(tmp_path / "runs" / "stopped" / name)
    uninterrupted = checkpoint_contents(cwd / "runs" / "whole" / name)
    stopped_arrays, uninterrupted_arrays = leaves(stopped["state"]), leaves(uninterrupted["state"])
    assert stopped_arrays.keys() == uninterrupted_arrays.keys()
    assert "/params/params/MLP_0/Dense_0/kernel" in stopped_arrays, sorted(stopped_arrays)
    for key, array in uninterrupted_arrays.items():
        saved = stopped_arrays[key]
        assert (saved.dtype, saved.shape) == (array.dtype, array.shape), key
        assert saved.tobytes() == array.tobytes(), key
    counters, uninterrupted_counters = stopped["counters"], uninterrupted["counters"]
    assert counters["update"] == 3 and counters["wall_time_s"] > 0
    options, uninterrupted_options = counters.pop("options"), uninterrupted_counters.pop("options")
    del counters["wall_time_s"], uninterrupted_counters["wall_time_s"]
    assert counters == uninterrupted_counters
    assert options["script"] == uninterrupted_options["script"] == SCRIPT.name
    assert {
        option
        for option in options["args"].keys() | uninterrupted_options["args"].keys()
        if options["args"].get(option) != uninterrupted_options["args"].get(option)
    } == {"run_name", "checkpoint_every"}


def checkpoint_contents(path) -> dict:
    """A checkpoint's state dict and counters, its checksum checked: the file is a hex sha256 of
    the msgpack payload, then the payload (cleanba_utils/checkpoints.py)."""
    data = path.read_bytes()
    digest, payload = data[:64], data[64:]
    assert hashlib.sha256(payload).hexdigest().encode() == digest, path
    return flax.serialization.msgpack_restore(payload)


def leaves(tree, prefix: str = "") -> dict[str, np.ndarray]:
    """The arrays of a state dict by their paths."""
    if isinstance(tree, dict):
        return {
            path: leaf
            for key, value in tree.items()
            for path, leaf in leaves(value, f"{prefix}/{key}").items()
        }
    return {prefix: np.asarray(tree)}


def test_at_its_defaults_the_minimal_script_learns_cartpole_in_under_a_minute(tmp_path):
    """The page's command at the script's defaults (CartPole, 200,000 steps, seed 1), as a user
    runs it: it exits within a minute, and the mean return of its last 100 training episodes is at
    least 70 above that of its first 100 (the score of tests/test_learning.py).

    Measured on this project's 2-core x86 CPU machine, 2026-11-27, other jobs sharing the cores,
    seeds 1-5: improvements 450.2, 191.3, 396.0, 460.6, 141.5 (the last 100 episodes 480.1, 217.1,
    425.9, 478.7, 165.6; the first 100 18 to 30), in 22.2 to 29.1 s from the command to its exit;
    the greedy policy's 20 evaluation episodes 500.0, 278.6, 500.0, 500.0, 137.1. A frozen
    learner (--learning-rate 1e-12), seeds 1-3: 0.8, 1.6, -1.3, in 31.8 to 35.6 s. Threshold 70: 71
    below the worst seed, 68 above the best frozen run; a minute is twice the slowest seed's
    time."""
    [line] = [line for line in PAGE.read_text().splitlines() if "# its defaults" in line]
    words = shlex.split(line.split("#")[0])
    assert words[:4] == ["uv", "run", "python", "docs/examples/cleanba_a2c_minimal.py"], words
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(REPO / words[3]), *words[4:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    defaults = load_script().Args()
    steps_per_update = defaults.local_num_envs * defaults.num_steps
    assert defaults.total_timesteps == 200_000 and defaults.env_id == "CartPole-v1"
    assert summary["global_step"] == defaults.total_timesteps // steps_per_update * steps_per_update
    returns = np.array([value for _, value in scalars(run_dir, "charts/episodic_return")])
    assert len(returns) >= 200, len(returns)
    improvement = returns[-100:].mean() - returns[:100].mean()
    assert improvement >= 70, (improvement, returns[:100].mean(), returns[-100:].mean())
    assert seconds < 60, seconds


def section(text: str, heading: str) -> str:
    """The part of a Markdown page under `## heading`, up to the next heading of that level."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def dotted_name(node) -> str | None:
    """`name` or `a.b.name` of a called expression; None for anything else (a call's result)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        prefix = dotted_name(node.value)
        return prefix and f"{prefix}.{node.attr}"
    return None


class ScriptCalls:
    """The calls of a script, parsed: each call by the names the page may write it with, the name
    in the source and, for a name imported from `cleanba_utils.<module>`, `<module>.<name>` (but
    for `cleanba_utils.run`: the page's `run.` is the run that `open_run` returns)."""

    def __init__(self, source: str):
        self.tree = ast.parse(source)
        self.functions = {
            node.name: node for node in self.tree.body if isinstance(node, ast.FunctionDef)
        }
        self.imported = {
            alias.asname or alias.name: f"{node.module.removeprefix('cleanba_utils.')}.{alias.name}"
            for node in self.tree.body
            if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("cleanba_utils.")
            and node.module != "cleanba_utils.run"
            for alias in node.names
        }

    def names_of(self, call: ast.Call) -> set[str]:
        name = dotted_name(call.func)
        if name is None:
            return set()
        head, dot, rest = name.partition(".")
        return {name, self.imported[head] + dot + rest} if head in self.imported else {name}

    def calls_in(self, node) -> list[ast.Call]:
        """The calls in `node`, in source order (a call before the calls of its arguments)."""
        calls = [call for call in ast.walk(node) if isinstance(call, ast.Call)]
        return sorted(calls, key=lambda call: (call.lineno, call.col_offset))

    def called(self) -> set[str]:
        """Every name the script calls, anywhere."""
        return {name for call in self.calls_in(self.tree) for name in self.names_of(call)}

    def run_order(self, function: str = "main", within=()) -> list[set[str]]:
        """The calls of a run from `function`, each call of the script's own functions followed by
        that function's calls (the order of a run, as far as the source gives it: no loop is
        unrolled, and the threads' functions, which the script hands on, are not followed)."""
        order = []
        for call in self.calls_in(self.functions[function]):
            names = self.names_of(call)
            order.append(names)
            for name in names & self.functions.keys():
                if name not in within:
                    order += self.run_order(name, (*within, function))
        return order


def pages_sequence() -> tuple[list[list[str]], list[list[str]]]:
    """The page's sequence of calls, its numbered steps: the calls (`name(`) of each step's head (up
    to its first `: `), and all the calls each step writes."""
    sequence = section(PAGE.read_text(), "The sequence of calls")
    numbered = re.findall(r"^(\d+)\. (.*?)(?=^\d+\. |^\S|\Z)", sequence, re.M | re.S)
    assert [int(number) for number, _ in numbered] == list(range(1, len(numbered) + 1)), numbered
    steps = [step for _, step in numbered]
    return [re.findall(r"`([A-Za-z_][\w.]*)\(", step.split("`: ")[0]) for step in steps], [
        re.findall(r"`([A-Za-z_][\w.]*)\(", step) for step in steps
    ]


# The calls of the page that a script does not make itself: it hands the function to the call that
# makes it.
HANDED_ON = {"actor_thread": "handoff.start_actor_threads"}


def test_every_call_of_the_pages_sequence_is_in_the_minimal_script():
    heads, steps = pages_sequence()
    calls = {call for step in steps for call in step}
    expected = {"open_run", "run.learner_loop", "actors.take_rollouts", "run.after_update"}
    assert expected <= calls, expected - calls
    script = ScriptCalls(SCRIPT.read_text())
    called = script.called()
    assert sorted(calls - called - HANDED_ON.keys()) == []
    for function, caller in HANDED_ON.items():
        assert [
            call
            for call in script.calls_in(script.tree)
            if caller in script.names_of(call)
            and call.args
            and dotted_name(call.args[0]) == function
        ], f"the script does not hand {function} to {caller}"
    assert all(heads), heads


def test_the_minimal_script_makes_the_pages_steps_in_the_pages_order():
    """The page numbers its steps in the order of a run: the script's run from `main` makes each
    step's calls after the step before."""
    heads, _ = pages_sequence()
    order = ScriptCalls(SCRIPT.read_text()).run_order()
    position = 0
    for number, head in enumerate(heads, start=1):
        for call in head:
            made_at = [i for i in range(position, len(order)) if call in order[i]]
            assert made_at, f"step {number}: {call} is not called after step {number - 1}'s calls"
            position = made_at[0] + 1


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
            assert fields.CHECK in field.metadata, f"--{field.name} declares no check"
