"""A run's logs and console: its TensorBoard writer (a failed write caught, `guard_events`), the
scalars every script logs after an update (`log_update`), the episodes' statistics, and the
console's lines: an update's progress, and a line whenever the console has been silent a while."""

import dataclasses
import os
import threading
import time
from collections import deque
from typing import NamedTuple

import jax
import numpy as np
from tensorboardX import SummaryWriter

from cleanba_utils import devices
from cleanba_utils.episodes import Episodes

PROGRESS_SECONDS = float(os.environ.get("CLEANBA_PROGRESS_SECONDS", 60))
"""the longest the console stays silent while a run trains: a line says which update is in
progress, also in the middle of a long one (CLEANBA_PROGRESS_SECONDS sets it)"""
SLOW_RUN_DAYS = 1.0
"""a run on the CPU backend that would take longer than this says so after its first update"""


class LearnerTimes(NamedTuple):
    """The learner's seconds in an update, which `RunLogs.log_update` logs as stats/<name>."""

    rollout_queue_get_time: float
    """waiting for the update's rollouts"""
    learn_time: float
    """from the rollouts' arrival to the update's end (what each script counts in it: its own)"""


@dataclasses.dataclass
class RunLogs:
    """The run's TensorBoard writer and console (process 0's writes; the others' writer writes
    nothing)."""

    args: object
    sizes: object
    writer: SummaryWriter
    first_update: int
    """the update this session started from: 0, or a resumed run's checkpoint"""
    recent_returns: deque = dataclasses.field(default_factory=lambda: deque(maxlen=100))
    """the returns of the last 100 finished episodes, for the console"""
    start_time: float = dataclasses.field(default_factory=time.time)
    last_update: int = 0
    """the newest update the loop has finished (or, GALA's async gossip, printed)"""
    last_console_time: float = dataclasses.field(default_factory=time.time)
    progress_done: threading.Event = dataclasses.field(default_factory=threading.Event)
    """set when the run stops training: the progress thread ends (it must not outlive Python's
    exit, which ends a daemon thread that wakes then and can abort the process)"""
    progress_thread: threading.Thread | None = None
    optimizer_rate: tuple | None = None
    """(optimizer steps, time) at the last console line of `log_update`: its rate's start"""
    slow_run_noted: bool = False
    """a note has said that the run would take days on this CPU"""
    events_failure: tuple | None = None
    """(path, OSError) of the first write of the TensorBoard events that failed (`guard_events`)"""
    close_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """held while the TensorBoard writer closes, which two threads ending the run may ask for"""

    def __post_init__(self):
        self.last_update = self.first_update
        guard_events(self.writer, self.note_events_failure)

    def start_progress(self, end_if_events_failed):
        """Starts the thread of `watch_progress`."""
        self.progress_thread = threading.Thread(
            target=self.watch_progress,
            args=(end_if_events_failed,),
            name="progress",
            daemon=True,
        )
        self.progress_thread.start()

    def end_progress(self):
        self.progress_done.set()
        if self.progress_thread is not None:
            self.progress_thread.join()

    def episodes(self, num_envs: int) -> Episodes:
        return Episodes(
            self.writer, self.recent_returns, np.zeros(num_envs), np.zeros(num_envs, dtype=np.int64)
        )

    def log(self, scalars: dict, global_step: int):
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step)

    def note_events_failure(self, path: str, error: OSError):
        """Called by `guard_events` in the thread whose write failed; the learner's
        `after_update` and the progress thread end the run (`Stops.end_if_events_failed`)."""
        if self.events_failure is None:
            self.events_failure = (path, error)

    def close(self):
        """Flushes and closes the TensorBoard writer (`guard_events` notes a failed write)."""
        with self.close_lock:
            self.writer.close()

    def sps(self, global_step: int) -> int:
        """Environment steps per second of this session (a resumed run counts from its resume)."""
        first_step = self.first_update * self.sizes.steps_per_update
        return int((global_step - first_step) / (time.time() - self.start_time))

    def note_learner_pace(self, step_seconds: float, steps: int, instead: str):
        """On a CPU, a run whose learner alone would take days says so within minutes, from one
        timed step of its first update (`microbatches.microbatch_update`'s `on_step_timed`), with
        the command `instead` sized for a CPU. The run goes on."""
        updates = self.sizes.num_updates - self.first_update
        seconds = step_seconds * steps * updates
        if jax.default_backend() != "cpu" or seconds <= SLOW_RUN_DAYS * 86400:
            return
        self.slow_run_noted = True
        print(
            f"note: one learner step took {step_seconds:.1f} s on this CPU, so the run's {updates} "
            f"updates of {steps} steps would take at least {seconds / 86400:.1f} days in the "
            "learner alone: the configuration is sized for accelerators. The run goes on (Ctrl-C "
            f"stops it); a run sized for a CPU: {instead}",
            flush=True,
        )

    def note_finished(self, update: int, untrained_evaluation_s: float):
        """After the session's first update on a CPU, a run that would take days says so once (the
        evaluation before the first update, `untrained_evaluation_s`, left out), unless its
        learner's pace said so already."""
        first_update = self.first_update
        cpu = jax.default_backend() == "cpu"
        if update == first_update + 1 and cpu and not self.slow_run_noted:
            first_update_s = time.time() - self.start_time - untrained_evaluation_s
            seconds = first_update_s * (self.sizes.num_updates - first_update)
            if seconds > SLOW_RUN_DAYS * 86400:
                print(
                    f"note: the first update took {first_update_s:.0f} s on this "
                    f"CPU, so the run's {self.sizes.num_updates} updates would take about "
                    f"{seconds / 86400:.1f} days: the configuration is sized for accelerators (the "
                    'README\'s "Try it on a CPU" has commands sized for one)',
                    flush=True,
                )
        self.last_update = max(self.last_update, update)

    def watch_progress(self, end_if_events_failed):
        """In a thread of its own: a line whenever the console has been silent for
        PROGRESS_SECONDS while the run trains (its first update, a long one, slow rollouts); the
        run's end within a second of a failed write of its TensorBoard events."""
        while not self.progress_done.wait(min(1.0, PROGRESS_SECONDS)):
            end_if_events_failed()
            if time.time() - self.last_console_time < PROGRESS_SECONDS:
                continue
            update = self.last_update
            step = update * self.sizes.steps_per_update
            finished = update - self.first_update
            elapsed = time.time() - self.start_time
            eta = "unknown until an update has ended"
            if finished:
                eta = duration((self.sizes.num_updates - update) * elapsed / finished)
            print(
                f"in progress: update {update + 1}/{self.sizes.num_updates} "
                f"step={step} SPS={self.sps(step)} elapsed={elapsed / 60:.1f}min "
                f"ETA={eta}",
                flush=True,
            )
            self.last_console_time = time.time()

    def print_progress(self, update: int, global_step: int, details: str):
        """The console line of an update: progress, speed, the mean of the last 100 returns, the
        script's `details`, and the time left at this session's pace."""
        self.last_update = max(self.last_update, update)
        self.last_console_time = time.time()
        seconds_per_update = (time.time() - self.start_time) / max(update - self.first_update, 1)
        eta = duration((self.sizes.num_updates - update) * seconds_per_update)
        mean_return = f"{np.mean(self.recent_returns):.1f}" if self.recent_returns else "n/a"
        print(
            f"update {update}/{self.sizes.num_updates} step={global_step} "
            f"SPS={self.sps(global_step)} return={mean_return} {details} ETA={eta}",
            flush=True,
        )

    def log_update(
        self,
        update: int,
        rollouts: list,
        metrics,
        learner_times: "LearnerTimes",
        optimizer_steps: int,
        learning_rate: float | None = None,
        details: str = "",
        replay_size: int | None = None,
        stats: dict | None = None,
    ):
        """What every script logs after a learner update. Every update: the actors' mean timings
        (each rollout's `timing`, a `handoff.ActorTimes`), the policy version they played, the
        learner's policy version (`update`: the policy of version v is the learner's after v
        updates), the learner's `learner_times` and the script's own `stats` (logged as they are),
        each under stats/; the optimizer steps so far, SPS and the learning rate. An off-policy
        script gives its `replay_size`, logged with the policy lag of the update's data (param_lag)
        and an actor thread's environment steps per second while it plays (actor_sps). Every
        --log-frequency updates and at the last: the losses (`metrics`, per learner device; None
        before the first update that learned), the optimizer steps per second since the last such
        line, and a console line with the script's `details`."""
        global_step = update * self.sizes.steps_per_update
        timing = mean_timing(rollouts)
        actor_policy_version = rollouts[0].policy_version
        learner_stats = {**learner_times._asdict(), **(stats or {})}
        if replay_size is not None:
            param_lag = update - 1 - actor_policy_version
            actor_sps = self.args.local_num_envs * self.args.num_steps / timing["rollout_time"]
            learner_stats = dict(
                learner_stats, replay_size=replay_size, param_lag=param_lag, actor_sps=actor_sps
            )
            details = f"replay={replay_size} policy lag={param_lag} {details}"
        stats = {
            **timing,
            **learner_stats,
            "learner_policy_version": update,
            "actor_policy_version": actor_policy_version,
            "optimizer_steps": optimizer_steps,
        }
        charts = {"charts/SPS": self.sps(global_step)}
        if learning_rate is not None:
            charts["charts/learning_rate"] = learning_rate
        self.log({f"stats/{key}": value for key, value in stats.items()} | charts, global_step)
        if self.optimizer_rate is None:
            self.optimizer_rate = (optimizer_steps, time.time())
        if update % self.args.log_frequency and update != self.sizes.num_updates:
            return
        steps_before, time_before = self.optimizer_rate
        self.optimizer_rate = (optimizer_steps, time.time())
        steps_per_second = (optimizer_steps - steps_before) / max(time.time() - time_before, 1e-9)
        self.log({"stats/optimizer_steps_per_second": steps_per_second}, global_step)
        if metrics is not None:
            losses = jax.device_get(devices.first_replica(metrics))
            self.log({f"losses/{key}": value for key, value in losses.items()}, global_step)
        line = (
            f"policy actor={actor_policy_version} learner={update} "
            f"optimizer steps={optimizer_steps} ({steps_per_second:.0f}/s) "
            f"wait rollout={learner_times.rollout_queue_get_time:.2f}s "
            f"param={timing['param_queue_get_time']:.2f}s"
        )
        self.print_progress(update, global_step, f"{line} {details}".strip())


def mean_timing(rollouts: list) -> dict:
    """The mean over an update's rollouts of each timing their actors measured (`timing`, a
    `handoff.ActorTimes`; a timing an actor does not measure is None)."""
    return {
        name: np.mean([getattr(rollout.timing, name) for rollout in rollouts])
        for name, value in rollouts[0].timing._asdict().items()
        if value is not None
    }


def guard_events(writer: SummaryWriter, on_failure):
    """tensorboardX writes the event file in a thread of its own, which a failed write (a full disk)
    ends with a traceback; its queue of events then fills, and the next log waits forever. The
    writes of `writer`'s event file go through here instead: the first that fails is handed to
    `on_failure(path, error)`, and those after it are dropped. (A writer that does not write to
    disk, a process other than 0's, has no event file.)"""
    event_file = getattr(writer.file_writer, "event_writer", None)
    if event_file is None:
        return
    events = event_file._ev_writer
    failures = []

    def guarded(write):
        def call(*args):
            if failures:
                return None
            try:
                return write(*args)
            except OSError as error:
                failures.append(error)
                on_failure(events._file_name, error)
                return None

        return call

    for method in ("write_event", "flush", "close"):
        setattr(events, method, guarded(getattr(events, method)))


def duration(seconds: float) -> str:
    """A time left as the console shows it: minutes, hours past 2 hours, days past 2 days."""
    if seconds < 7200:
        return f"{seconds / 60:.1f}min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}days"
