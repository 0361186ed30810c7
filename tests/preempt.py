"""Preemption inside a test driver (a process that runs a script's `main` once per command): SIGTERM
sent to the process while update k runs, as SLURM's preemption arrives, then the resumed run."""

import os
import signal
import time


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
