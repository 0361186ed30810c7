"""Preemption inside a test driver (a process that runs a script's `main` once per command): SIGTERM
sent to the process while update k runs, as SLURM's preemption arrives, then the resumed run; and
what the test asserts of it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def preempted_then_resumed(script, argv: list, update: int) -> int:
    """Runs `script.main(argv)` with SIGTERM arriving during update `update`, then `argv` with
    --resume; returns the exit code of the preempted run."""
    open_run = script.open_run

    def signalled_open_run(*args, **kwargs):
        run = open_run(*args, **kwargs)
        after_update = run.after_update

        def after_a_signal(state, at: int):
            if at == update:
                os.kill(os.getpid(), signal.SIGTERM)
                while not run.received_signals:
                    time.sleep(0.01)
            return after_update(state, at)

        run.after_update = after_a_signal
        return run

    script.open_run = signalled_open_run
    try:
        script.main(argv)
    except SystemExit as exit_:
        exit_code = exit_.code
    else:
        exit_code = 0
    finally:
        script.open_run = open_run
    script.main([*argv, "--resume"])
    return exit_code


def run_command(script, command: dict):
    """A driver's command: `script.main` with its arguments and run name, or with
    "preempted_after": k, preempted during update k and resumed (the exit code of the preempted
    run goes to <name>.preempted.json)."""
    argv = [*command["argv"], "--run-name", command["name"]]
    if not command.get("preempted_after"):
        script.main(argv)
        return
    exit_code = preempted_then_resumed(script, argv, command["preempted_after"])
    Path(f"{command['name']}.preempted.json").write_text(json.dumps(exit_code))


def assert_resumed_as_uninterrupted(run_dirs, stdout: str, name: str, source: str, update: int):
    """Run `name`, preempted during update `update` (exit 143) and resumed, ends with the
    parameters of the uninterrupted run `source`, bit for bit."""
    assert json.loads((run_dirs.parent / f"{name}.preempted.json").read_text()) == 143
    assert f"resuming {name} from update {update}" in stdout
    fingerprints = [
        json.loads((run_dirs / run / "summary.json").read_text())["params_fingerprint"]
        for run in (name, source)
    ]
    assert fingerprints[0] == fingerprints[1]


WHOLE_THEN_RESUMED = """
import importlib
import json
import sys

sys.path.insert(0, sys.argv[3])
from preempt import run_command  # noqa: E402

script = importlib.import_module(f"cleanba.{sys.argv[1]}")
argv = json.loads(sys.argv[2])
run_command(script, dict(argv=argv, name="whole"))
run_command(script, dict(argv=argv, name="resumed", preempted_after=int(sys.argv[4])))
"""


def assert_a_resumed_run_is_the_whole_one(tmp_path, script: str, argv: list, update: int):
    """In one driver process (`script`'s `main` called twice, so that it compiles once): the run
    `argv` whole, then again preempted during update `update` and resumed; the resumed run ends
    with the whole run's parameters, bit for bit."""
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            *[sys.executable, "-c", WHOLE_THEN_RESUMED, script, json.dumps(argv)],
            *[str(repo / "tests"), str(update)],
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_resumed_as_uninterrupted(tmp_path / "runs", result.stdout, "resumed", "whole", update)
