"""Preemption inside a test driver (a process that runs a script's `main` once per command): SIGTERM
sent to the process while update k runs, as SLURM's preemption arrives, then the resumed run; and
what the test asserts of it."""

import json
import os
import signal
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
