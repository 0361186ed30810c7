"""A run's stops and checkpoints: the stop of all threads when one fails or the run ends, stop
signals (Ctrl-C at once; SIGTERM / SIGUSR1 after a checkpoint, `signals`), the checkpoints of the
schedule and of a stop, the run's files and the end of the process with one line and its exit
code."""

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque

import jax

from cleanba_utils import distributed, run_files, signals
from cleanba_utils.checkpoints import FIRST_REPLICA, Checkpointing, save_checkpoint
from cleanba_utils.errors import fail
from cleanba_utils.run_logs import RunLogs
from cleanba_utils.threads import Stopped

# XLA reports a device allocation it cannot make as RESOURCE_EXHAUSTED: the run asked for more than
# the device holds, which the user fixes with the options that size one learner step or one actor
# batch; each script names those it has.
MEMORY_OPTIONS = {
    "local_num_envs": "fewer --local-num-envs",
    "batch_size": "a smaller --batch-size",
    "num_minibatches": "more --num-minibatches",
    "gradient_accumulation_steps": (
        "more --gradient-accumulation-steps (the same result in less memory)"
    ),
}
WRITE_FAILED_EXIT_CODE = 1
"""the exit code of a run that could not write a checkpoint or a run file"""


@dataclasses.dataclass
class LoopEnd:
    """How the learner's loop ended: 0 when it ran to its last update, else the process's exit
    code."""

    exit_code: int = 0


@dataclasses.dataclass
class Stops:
    """The stops of one run and its checkpoints (process 0 writes them)."""

    args: object
    sizes: object
    dir: str
    counters: dict
    """what a checkpoint saves besides the state: the update, the wall time before a resume, sizes,
    seed, and the script and its options (`checkpoints.options_record`), which --resume compares"""
    logs: RunLogs
    stop_agreed: object
    """a function of `received_signals`: True when any process of the run received a stop signal"""
    checkpointing: Checkpointing = FIRST_REPLICA
    """how a checkpoint is made of what `after_update` gets"""
    received_signals: list | None = None
    """the stop signals received, in order (`signals.catch_stop_signals`, which acts on them with
    `stop_now`)"""
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    """set when the run ends or any thread fails: every queue wait gives up"""
    failures: list = dataclasses.field(default_factory=list)
    """tracebacks of the threads that failed"""
    broken_run: bool = False
    """a collective failed because a peer of the distributed run has gone"""
    completed: deque = dataclasses.field(default_factory=lambda: deque(maxlen=2))
    """(update, what `after_update` got) of the last two updates: a stop in the middle of an update
    saves the newest whose arrays are computed"""
    checkpoint_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    newest_checkpoint: int = 0
    """the update of the newest checkpoint in the run folder (0: none)"""
    training_done: bool = False
    """set after the last update: a stop signal then lets the run finish"""
    leaving: bool = False
    """set when the learner loop has stopped early and the process is ending"""
    quitting: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """held by the thread that ends the process (`quit`): one message, one exit code"""

    def __post_init__(self):
        if self.received_signals is None:
            self.received_signals = signals.catch_stop_signals(self.stop_now)
        self.newest_checkpoint = self.counters.get("update", 0)

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    def wall_time(self) -> float:
        """Seconds of the whole run, the time before a resume included."""
        return self.counters["wall_time_s"] + time.time() - self.logs.start_time

    def checkpoint(self, state, update: int):
        """Call with `checkpoint_lock` held."""
        state = self.checkpointing.on_host(state)
        if self.is_main:
            counters = {**self.counters, "update": update, "wall_time_s": self.wall_time()}
            try:
                save_checkpoint(self.dir, state, counters)
            except OSError as error:
                self.write_failed("checkpoint", error.filename, error)
        self.newest_checkpoint = update

    def write_json(self, name: str, obj):
        """`obj` as the JSON file `name` of the run folder (process 0's), written atomically."""
        path = os.path.join(self.dir, name)
        try:
            run_files.write_json_atomically(path, obj)
        except OSError as error:
            self.write_failed("run file", path, error)

    def write_failed(self, what: str, path, error: OSError):
        """A file of the run that cannot be written (a full disk, a read-only folder) ends the
        process at once with one line and exit WRITE_FAILED_EXIT_CODE, the newest checkpoint
        kept."""
        self.quit(
            WRITE_FAILED_EXIT_CODE,
            f"{run_files.write_failure(what, path, error)}; {self.kept_checkpoint()}",
        )

    def end_if_events_failed(self):
        if self.logs.events_failure is not None:
            self.write_failed("TensorBoard events", *self.logs.events_failure)

    def after_update(self, state, update: int, untrained_evaluation_s: float = 0.0) -> int:
        """Called with what a checkpoint of `update` saves (through `checkpointing`) as soon as the
        update is dispatched (its arrays may still be computing). Checkpoints as --checkpoint-every
        asks; on a stop signal received by any process, checkpoints and returns the exit code (128
        + the signal), else 0. A signal during the last update lets the run end. After the
        session's first update, a run that would take days says so (`RunLogs.note_finished`, the
        evaluation before it, `untrained_evaluation_s`, left out)."""
        self.end_if_events_failed()
        last = update == self.sizes.num_updates
        stop = self.stop_agreed(self.received_signals) and not last
        due = stop or (
            self.args.checkpoint_every and (update % self.args.checkpoint_every == 0 or last)
        )
        if due:
            # Outside the lock: a stop meanwhile saves the update before.
            wait_until_computed(state)
        self.logs.note_finished(update, untrained_evaluation_s)
        with self.checkpoint_lock:
            self.completed.append((update, state))
            self.training_done = last
            if due:
                self.checkpoint(state, update)
        if stop:
            print(
                f"stopped by a signal after update {update}; checkpoint saved, "
                "continue with --resume",
                file=sys.stderr,
            )
            return signals.exit_code_of(self.received_signals)
        return 0

    def stop_now(self, signum: int):
        """What a stop signal does, in a thread of its own (`signals`), whatever the learner is
        doing. Ctrl-C: the logs are flushed and the process exits 130, the newest checkpoint kept.
        SIGTERM / SIGUSR1: the learner loop checkpoints after its current update and leaves; if it
        has not within STOP_GRACE_SECONDS, the update in flight is abandoned and the last completed
        one is saved here, then the process exits 128 + the signal. Either way a resumed run
        continues as the uninterrupted one would have."""
        exit_code = 128 + signum
        if signum == signal.SIGINT:
            self.checkpoint_lock.acquire(timeout=signals.STOP_GRACE_SECONDS)
            self.quit(exit_code, f"interrupted: stopped; {self.kept_checkpoint()}")
        waited = 0.0
        while not self.leaving and waited < signals.STOP_GRACE_SECONDS:
            time.sleep(0.05)
            waited += 0.05
        if self.leaving:
            # The loop has stopped, its checkpoint saved. Python's exit waits for a computation in
            # flight (XLA's teardown): end the process if it is still there later, unless it went
            # on to train another run (a test driver), which watches the signals itself.
            while waited < 2 * signals.STOP_GRACE_SECONDS and signals.is_watching(self.stop_now):
                time.sleep(0.05)
                waited += 0.05
            if signals.is_watching(self.stop_now):
                self.quit(exit_code, None)
            return
        if not self.checkpoint_lock.acquire(timeout=signals.STOP_GRACE_SECONDS):
            self.quit(exit_code, f"stopped by a signal; {self.kept_checkpoint()}")
        if self.training_done:
            self.checkpoint_lock.release()
            return
        for lock in self.checkpointing.frozen_by:
            lock.acquire()
        computed = [(u, state) for u, state in self.completed if is_computed(state)]
        if not computed or (self.checkpointing.collective and self.args.distributed):
            self.quit(exit_code, f"stopped by a signal; {self.kept_checkpoint()}")
        update, state = computed[-1]
        if update > self.newest_checkpoint:
            self.checkpoint(state, update)
        self.quit(
            exit_code,
            f"stopped by a signal during update {update + 1}, which is abandoned; checkpoint of "
            f"update {update} saved, continue with --resume",
        )

    def kept_checkpoint(self) -> str:
        if self.newest_checkpoint:
            return f"the newest checkpoint (update {self.newest_checkpoint}) is kept"
        return "no checkpoint was saved"

    def quit(self, exit_code: int, message: str | None):
        """Ends the process at once, its logs flushed: not waiting for a computation in flight,
        which Python's exit would (XLA's teardown)."""
        if not self.quitting.acquire(blocking=False):
            # Another thread is ending the process.
            threading.Event().wait()
        if message:
            print(message, file=sys.stderr)
        self.logs.close()
        if self.args.track and self.is_main:
            import wandb

            # The process ends either way, and W&B's own errors (a full disk) would bury the line
            # above.
            with contextlib.suppress(Exception):
                wandb.finish(exit_code=exit_code)
        signals.end_process(exit_code)

    @contextlib.contextmanager
    def learner_loop(self, threads: list):
        """Wraps the learner's loop, which sets the yielded `LoopEnd.exit_code` when it stops early
        (a stop signal; Ctrl-C is `stop_now`'s). A queue wait given up because another thread
        failed is exit 1, and an exception of the loop is recorded as a failure; on leaving,
        `exit_if_stopped` stops the threads and ends the process unless the loop ran to its end."""
        end = LoopEnd()
        try:
            yield end
        except Stopped:
            end.exit_code = 1
        except Exception:
            self.record_failure()
        self.exit_if_stopped(end.exit_code, threads)

    def record_failure(self):
        """Called in the learner's `except Exception`: the traceback, or in a distributed run whose
        collective failed because a peer has gone, the one line that names the peer."""
        if self.args.distributed and distributed.is_broken_run(sys.exc_info()[1]):
            self.broken_run = True
            self.failures.append(distributed.broken_run_line() + "\n")
        else:
            self.failures.append(traceback.format_exc())

    def exit_if_stopped(self, exit_code: int, threads: list):
        """Stops and joins the threads; ends the process with the failures (exit 1) or `exit_code`
        if not 0. (A thread still in envpool's or XLA's C++ code when Python exits aborts the
        process; a stop's watcher ends one that takes too long, `stop_now`.)"""
        self.leaving = exit_code != 0 or bool(self.failures)
        self.stop.set()
        if self.leaving:
            self.logs.end_progress()
        for thread in threads:
            thread.join(timeout=10)
        if any("RESOURCE_EXHAUSTED" in failure for failure in self.failures):
            self.logs.close()
            fail(out_of_memory(self.args))
        if self.quitting.locked():
            # Another thread is ending the process (a Ctrl-C), which may have failed the threads
            # on its way (`gymnasium_envs.end_workers`).
            threading.Event().wait()
        if self.failures:
            print("".join(self.failures), file=sys.stderr, end="")
            exit_code = 1
            if self.broken_run:
                # Python's exit would shut jax.distributed down, which waits for the lost peer
                # until the heartbeat timeout and then aborts with the coordination service's
                # report: the line above says it all.
                self.quit(exit_code, None)
        if exit_code:
            self.logs.close()
            self.end_if_events_failed()
            sys.exit(exit_code)


def out_of_memory(args) -> str:
    options = [hint for name, hint in MEMORY_OPTIONS.items() if hasattr(args, name)]
    return "the device ran out of memory; shrink what one step holds: " + ", ".join(options)


def end_at_once(line: str):
    """Ends the process with `line` and exit WRITE_FAILED_EXIT_CODE, before a run has started."""
    print(line, file=sys.stderr, flush=True)
    signals.end_process(WRITE_FAILED_EXIT_CODE)


def is_computed(tree) -> bool:
    """Whether every JAX array of `tree` has been computed (its other leaves are host values)."""
    return all(leaf.is_ready() for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array))


def wait_until_computed(tree):
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.block_until_ready()
