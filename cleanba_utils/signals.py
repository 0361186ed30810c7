"""Stops: Ctrl-C (SIGINT) and SLURM's preemption signals (SIGTERM, SIGUSR1), acted on within
seconds whatever the learner is doing.

Python runs a signal's handler between two bytecodes of the main thread only, and a learner's main
thread can wait minutes for one XLA computation. So the signal's byte on a wakeup pipe (written by
Python's C-level handler at once) wakes a watcher thread, which hands the stop to `on_stop` in a
thread of its own and goes on watching:
- SIGTERM / SIGUSR1: the learner loop saves a checkpoint after its current update, every process of
  a distributed run after the same one (they vote); `on_stop` saves the last completed update's
  itself if the loop has not done so within STOP_GRACE_SECONDS (see `Stops.stop_now`).
- Ctrl-C: `on_stop` exits at once (130), keeping the newest checkpoint. Under `uv run` one Ctrl-C
  arrives twice (the terminal's SIGINT to the process group, then uv's forward): SIGINTs within
  SAME_CTRL_C_SECONDS of the first are that one stop; a later Ctrl-C quits at once."""

import contextlib
import os
import signal
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
WATCHED_SIGNALS = (signal.SIGINT, *STOP_SIGNALS)
STOP_GRACE_SECONDS = 10.0
"""how long the learner loop has to reach the end of its update after SIGTERM / SIGUSR1: SLURM
kills 30 s after its signal (KillWait, its default), and the checkpoint has to be written in the
rest (benchmark/results/slurm_stops.md times the stops, 2026-11-26)"""
SAME_CTRL_C_SECONDS = 1.0


class Watcher:
    """The received stop signals, in order, and what to do on the first. One per process: a
    process that runs several trainings (a test driver) watches with the newest's `on_stop`."""

    def __init__(self):
        self.received: list[int] = []
        self.on_stop = None
        self.first_ctrl_c = None
        self.read_end, self.write_end = os.pipe()
        os.set_blocking(self.write_end, False)
        threading.Thread(target=self.watch, name="stop-signals", daemon=True).start()

    def watch(self):
        while True:
            for signum in os.read(self.read_end, 64):
                self.note(signum)

    def note(self, signum: int):
        if signum == signal.SIGINT:
            if self.first_ctrl_c is not None:
                if time.monotonic() - self.first_ctrl_c > SAME_CTRL_C_SECONDS:
                    print("interrupted again: quitting", file=sys.stderr, flush=True)
                    end_process(130)
                return
            self.first_ctrl_c = time.monotonic()
        elif self.received:
            return
        self.received.append(signum)
        threading.Thread(target=self.on_stop, args=(signum,), name="stopper", daemon=True).start()


BEFORE_ENDING: list = []
"""functions that `end_process` calls first: the ending of worker processes the run started
(`gymnasium_envs`), which would otherwise outlive it"""


def end_process(exit_code: int):
    """Ends the process at once with `exit_code`, its output flushed: not waiting for a computation
    in flight, which Python's exit would (XLA's teardown). A function of BEFORE_ENDING that fails
    never keeps the process from ending."""
    try:
        for function in BEFORE_ENDING:
            with contextlib.suppress(Exception):
                function()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(exit_code)


def exit_at_once(signum: int):
    """The stop before a run has started and after it has finished: nothing to save."""
    sys.stdout.flush()
    print("interrupted" if signum == signal.SIGINT else "stopped by a signal", file=sys.stderr)
    end_process(128 + signum)


class Unfailing:
    """A console stream (stdout, stderr) whose writes that fail are dropped: a pipe whose reader has
    gone (the `tee` of `python ... | tee train.log` killed) or a file on a full disk. A stop prints
    its line before it acts, and what cannot be printed must never stop the stop, nor the run."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            return len(text)
        except ValueError:
            # A closed stream (the reader's end gone with it); another ValueError is a bug.
            if not self.stream.closed:
                raise
            return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            pass
        except ValueError:
            if not self.stream.closed:
                raise

    def __getattr__(self, name):
        return getattr(self.stream, name)


def never_fail_on_output():
    """Makes sys.stdout and sys.stderr `Unfailing` (once)."""
    if not isinstance(sys.stdout, Unfailing):
        sys.stdout = Unfailing(sys.stdout)
    if not isinstance(sys.stderr, Unfailing):
        sys.stderr = Unfailing(sys.stderr)


WATCHER: Watcher | None = None


def catch_stop_signals(on_stop=exit_at_once) -> list[int]:
    """Installs the handlers (from the main thread); the returned list receives the numbers of the
    signals that arrived, and `on_stop(signum)` runs in a thread of its own on the first."""
    global WATCHER
    never_fail_on_output()
    if WATCHER is None:
        WATCHER = Watcher()
    WATCHER.received = []
    WATCHER.first_ctrl_c = None
    WATCHER.on_stop = on_stop
    # A process started in the background by a shell script, or by a test runner's worker,
    # inherits an ignored SIGINT: a handler of our own makes Ctrl-C and `kill -INT` stop the run.
    for signum in WATCHED_SIGNALS:
        signal.signal(signum, lambda signum, frame: None)
    signal.set_wakeup_fd(WATCHER.write_end, warn_on_full_buffer=False)
    return WATCHER.received


def is_watching(on_stop) -> bool:
    """Whether `on_stop` is what the next stop signal runs (a process may train several runs)."""
    return WATCHER is not None and WATCHER.on_stop == on_stop


def ignore_stop_signals():
    """After a run's last output: a stop signal has nothing left to save, and the finished run exits
    0. (Python's shutdown restores the default action of the handlers it installed, and a SIGTERM
    that arrived then, from a launcher that stops a pruned trial, ended a finished run with -15.)
    Ctrl-C exits at once."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if WATCHER is not None:
        WATCHER.on_stop = exit_at_once


def stop_agreement(global_learner_devices: list, num_local_learner_devices: int, distributed: bool):
    """A function of `received` that is True when any process of the run received a stop signal.
    Every process must stop after the same update, or the others would wait for it in the next
    collective, so in a distributed run the learner devices of all processes vote with a psum."""
    import jax
    import numpy as np

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
