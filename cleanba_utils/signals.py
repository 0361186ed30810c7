"""Preemption: SIGTERM and SIGUSR1 (SLURM's signals) are noted when they arrive and acted on after
the current update, by every process of a distributed run at the same update. Ctrl-C (SIGINT) stops
at once."""

import signal

import jax
import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def catch_stop_signals() -> list[int]:
    """Installs the handlers; the returned list receives the numbers of the signals that arrived."""
    # A process started in the background by a shell script, or by a test runner's worker, inherits
    # an ignored SIGINT, and Python then leaves Ctrl-C ignored: `kill -INT` would not stop the run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    received: list[int] = []
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: received.append(signum))
    return received


def ignore_stop_signals():
    """After a run's last output: a stop signal has nothing left to save, and the finished run exits
    0. (Python's shutdown restores the default action of the handlers it installed, and a SIGTERM
    that arrived then, from a launcher that stops a pruned trial, ended a finished run with -15.)"""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def stop_agreement(global_learner_devices: list, num_local_learner_devices: int, distributed: bool):
    """A function of `received` that is True when any process of the run received a stop signal.
    Every process must stop after the same update, or the others would wait for it in the next
    collective, so in a distributed run the learner devices of all processes vote with a psum."""
    if not distributed:
        return lambda received: bool(received)
    any_process = jax.pmap(
        lambda flag: jax.lax.psum(flag, "devices"),
        axis_name="devices",
        devices=global_learner_devices,
    )

    def agreed(received) -> bool:
        return bool(
            np.asarray(any_process(np.full(num_local_learner_devices, bool(received), np.int32)))[0]
        )

    return agreed


def exit_code_of(received: list[int]) -> int:
    """128 + the signal number, the shell's convention; a stop that a peer received is reported as
    SIGTERM."""
    return 128 + (received[0] if received else signal.SIGTERM)
