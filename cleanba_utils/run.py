"""One training run's plumbing, shared by every script: its folder and logs, the stop of all
threads, stop signals (Ctrl-C, preemption), checkpoints, episode statistics and the end of the run.
The script keeps its algorithm, its actors and its learner loop; `Run` holds what the loop needs
besides."""

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from typing import NamedTuple

import jax
import numpy as np
from tensorboardX import SummaryWriter

from cleanba_utils import (
    accelerators,
    devices,
    distributed,
    gymnasium_envs,
    hub,
    run_files,
    signals,
)
from cleanba_utils.checkpoints import (
    FIRST_REPLICA,
    Checkpointing,
    save_checkpoint,
)
from cleanba_utils.env_ids import name_part
from cleanba_utils.episodes import Episodes
from cleanba_utils.errors import fail
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

# (global step, mean return) of every evaluation so far, in the run folder.
EVALUATIONS_FILE = "evaluations.json"
EVAL_SEED_OFFSET = 1_000_000
"""Evaluation environments are seeded with the run's seed + this: never the training ones."""

PROGRESS_SECONDS = float(os.environ.get("CLEANBA_PROGRESS_SECONDS", 60))
"""the longest the console stays silent while a run trains: a line says which update is in
progress, also in the middle of a long one (CLEANBA_PROGRESS_SECONDS sets it)"""
WRITE_FAILED_EXIT_CODE = 1
"""the exit code of a run that could not write a checkpoint or a run file"""
SLOW_RUN_DAYS = 1.0
"""a run on the CPU backend that would take longer than this says so after its first update"""


def out_of_memory(args) -> str:
    options = [hint for name, hint in MEMORY_OPTIONS.items() if hasattr(args, name)]
    return "the device ran out of memory; shrink what one step holds: " + ", ".join(options)


class LearnerTimes(NamedTuple):
    """The learner's seconds in an update, which `Run.log_update` logs as stats/<name>."""

    rollout_queue_get_time: float
    """waiting for the update's rollouts"""
    learn_time: float
    """from the rollouts' arrival to the update's end (what each script counts in it: its own)"""


@dataclasses.dataclass
class Run:
    args: object
    sizes: object
    script_path: str
    name: str
    dir: str
    writer: SummaryWriter
    evaluate: object
    """the script's `evaluate(params, args, num_episodes, seed)`: the returns of `num_episodes`
    episodes of the policy `params` (what `evaluate_and_log` and the end of the run play)"""
    counters: dict
    """what a checkpoint saves besides the state: the update, the wall time before a resume, sizes,
    seed, and the script and its options (`checkpoints.options_record`), which --resume compares"""
    stop_agreed: object
    """a function of `received_signals`: True when any process of the run received a stop signal"""
    model_card: object = None
    """the script's `hub.ModelCard` for --upload-model (None: its file name, no paper)"""
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    """set when the run ends or any thread fails: every queue wait gives up"""
    failures: list = dataclasses.field(default_factory=list)
    """tracebacks of the threads that failed"""
    broken_run: bool = False
    """a collective failed because a peer of the distributed run has gone"""
    received_signals: list | None = None
    """the stop signals received, in order (`signals.catch_stop_signals`, which acts on them with
    `stop_now`)"""
    recent_returns: deque = dataclasses.field(default_factory=lambda: deque(maxlen=100))
    """the returns of the last 100 finished episodes, for the console"""
    start_time: float = dataclasses.field(default_factory=time.time)
    evaluations: list = dataclasses.field(default_factory=list)
    """(global step, mean return) of the run's evaluations, those made before a resume included"""
    last_evaluation: tuple | None = None
    """(update, returns of its episodes) of this process's newest evaluation"""
    untrained_evaluation_s: float = 0.0
    """seconds of the evaluation at step 0 (`evaluate_untrained`), which the estimate of the run's
    duration after its first update leaves out"""
    checkpointing: Checkpointing = FIRST_REPLICA
    """how a checkpoint is made of what `after_update` gets"""
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
    last_update: int = 0
    """the newest update the loop has finished (or, GALA's async gossip, printed)"""
    last_console_time: float = dataclasses.field(default_factory=time.time)
    progress_done: threading.Event = dataclasses.field(default_factory=threading.Event)
    """set when the run stops training: the progress thread ends (it must not outlive Python's
    exit, which ends a daemon thread that wakes then and can abort the process)"""
    progress_thread: threading.Thread | None = None
    optimizer_rate: tuple | None = None
    """(optimizer steps, time) at the last console line of `log_update`: its rate's start"""
    events_failure: tuple | None = None
    """(path, OSError) of the first write of the TensorBoard events that failed (`guard_events`)"""
    quitting: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """held by the thread that ends the process (`quit`): one message, one exit code"""
    logs_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """held while the TensorBoard writer closes, which two threads ending the run may ask for"""

    def __post_init__(self):
        if self.received_signals is None:
            self.received_signals = signals.catch_stop_signals(self.stop_now)
        self.newest_checkpoint = self.counters.get("update", 0)
        self.last_update = self.counters.get("update", 0)

    def end_progress(self):
        self.progress_done.set()
        if self.progress_thread is not None:
            self.progress_thread.join()

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    def wall_time(self) -> float:
        """Seconds of the whole run, the time before a resume included."""
        return self.counters["wall_time_s"] + time.time() - self.start_time

    def episodes(self, num_envs: int) -> Episodes:
        return Episodes(
            self.writer, self.recent_returns, np.zeros(num_envs), np.zeros(num_envs, dtype=np.int64)
        )

    def log(self, scalars: dict, global_step: int):
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step)

    def evaluation_due(self, update: int) -> bool:
        """With --eval-episodes: every --eval-every updates, and after the last one. The same answer
        in every process (a script whose parameters need a collective gathers them in all)."""
        args = self.args
        every = args.eval_every
        due = update == self.sizes.num_updates or (every > 0 and update % every == 0)
        return args.eval_episodes > 0 and due

    def evaluate_untrained(self, policy):
        """SLM Lab's first checkpoint: with --eval-every, a run that starts from scratch evaluates
        its untrained policy before the first update, at global step 0 and optimizer steps 0, as
        `evaluate_and_log` (a resumed run made that evaluation before its checkpoint). `policy()`
        gives what the script's `evaluate` plays, the expression of its evaluations after an
        update; it is called in every process, as those are."""
        args = self.args
        if self.counters["update"] or not (args.eval_every > 0 and args.eval_episodes > 0):
            return
        started = time.time()
        self.evaluate_and_log(0, policy(), 0)
        self.untrained_evaluation_s = time.time() - started

    def evaluate_and_log(self, update: int, params, optimizer_steps: int):
        """Plays --eval-episodes episodes of `params` with the script's `evaluate`, in environments
        of the evaluation seed (the run's + 1,000,000), in the process that logs. Their mean return
        is logged as charts/eval_return and the learner's optimizer steps so far as charts/opt_step,
        both at the update's global step, and kept for summary.json (in the run folder too: a
        resumed run's summary lists the evaluations made before its checkpoint). With
        --capture-video the first episode is filmed (`gymnasium_envs.filming`): an mp4 in the run
        folder and videos/eval in TensorBoard."""
        if not self.is_main:
            return
        args = self.args
        global_step = update * self.sizes.steps_per_update
        film = None
        if args.capture_video:
            path = os.path.join(self.dir, "videos", f"eval_{global_step:012d}.mp4")
            film = gymnasium_envs.Film(path)
        with gymnasium_envs.filming(film):
            returns = self.evaluate(params, args, args.eval_episodes, args.seed + EVAL_SEED_OFFSET)
        if film is not None and film.frames is not None:
            # (batch, time, channels, height, width), as tensorboardX takes a video.
            video = np.transpose(film.frames[None], (0, 1, 4, 2, 3))
            self.writer.add_video("videos/eval", video, global_step, fps=film.fps)
        mean_return = float(np.mean(returns))
        self.log(
            {"charts/eval_return": mean_return, "charts/opt_step": optimizer_steps}, global_step
        )
        print(f"eval: mean return {mean_return:.1f} at step {global_step}", flush=True)
        self.evaluations.append([global_step, mean_return])
        self.last_evaluation = (update, returns)
        self.write_json(EVALUATIONS_FILE, self.evaluations)

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

    def note_events_failure(self, path: str, error: OSError):
        """Called by `guard_events` in the thread whose write failed; the learner's
        `after_update` and the progress thread end the run (`end_if_events_failed`)."""
        if self.events_failure is None:
            self.events_failure = (path, error)

    def end_if_events_failed(self):
        if self.events_failure is not None:
            self.write_failed("TensorBoard events", *self.events_failure)

    def after_update(self, state, update: int) -> int:
        """Called with what a checkpoint of `update` saves (through `checkpointing`) as soon as the
        update is dispatched (its arrays may still be computing). Checkpoints as --checkpoint-every
        asks; on a stop signal received by any process, checkpoints and returns the exit code (128
        + the signal), else 0. A signal during the last update lets the run end."""
        self.end_if_events_failed()
        last = update == self.sizes.num_updates
        stop = self.stop_agreed(self.received_signals) and not last
        due = stop or (
            self.args.checkpoint_every and (update % self.args.checkpoint_every == 0 or last)
        )
        if due:
            # Outside the lock: a stop meanwhile saves the update before.
            wait_until_computed(state)
        self.note_finished(update)
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
        self.close_logs()
        if self.args.track and self.is_main:
            import wandb

            # The process ends either way, and W&B's own errors (a full disk) would bury the line
            # above.
            with contextlib.suppress(Exception):
                wandb.finish(exit_code=exit_code)
        signals.end_process(exit_code)

    def close_logs(self):
        """Flushes and closes the TensorBoard writer (`guard_events` notes a failed write)."""
        with self.logs_lock:
            self.writer.close()

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

    def sps(self, global_step: int) -> int:
        """Environment steps per second of this session (a resumed run counts from its resume)."""
        first_step = self.counters["update"] * self.sizes.steps_per_update
        return int((global_step - first_step) / (time.time() - self.start_time))

    def note_finished(self, update: int):
        """After the session's first update on a CPU, a run that would take days says so once."""
        first_update = self.counters["update"]
        if update == first_update + 1 and jax.default_backend() == "cpu":
            first_update_s = time.time() - self.start_time - self.untrained_evaluation_s
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

    def watch_progress(self):
        """In a thread of its own: a line whenever the console has been silent for
        PROGRESS_SECONDS while the run trains (its first update, a long one, slow rollouts); the
        run's end within a second of a failed write of its TensorBoard events."""
        while not self.progress_done.wait(min(1.0, PROGRESS_SECONDS)):
            self.end_if_events_failed()
            if time.time() - self.last_console_time < PROGRESS_SECONDS:
                continue
            update = self.last_update
            step = update * self.sizes.steps_per_update
            finished = update - self.counters["update"]
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
        first_update = self.counters["update"]
        seconds_per_update = (time.time() - self.start_time) / max(update - first_update, 1)
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
        timing = {
            name: np.mean([getattr(r.timing, name) for r in rollouts])
            for name, value in rollouts[0].timing._asdict().items()
            if value is not None
        }
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
            self.end_progress()
        for thread in threads:
            thread.join(timeout=10)
        if any("RESOURCE_EXHAUSTED" in failure for failure in self.failures):
            self.close_logs()
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
            self.close_logs()
            self.end_if_events_failed()
            sys.exit(exit_code)

    def finish(self, params, update: int, optimizer_steps: int):
        """After the last update: the model file, the final evaluation's episodes (the one the loop
        made after its last update, else one made here by `evaluate_and_log`), summary.json, the
        upload of --upload-model and the fingerprint as the last line of stdout; stop signals are
        ignored from then on. A model that could not be uploaded ends the process with one line and
        exit code hub.UPLOAD_FAILED_EXIT_CODE, every file of the run written."""
        args = self.args
        self.training_done = True
        self.end_progress()
        wall_time_s = self.wall_time()
        global_step = update * self.sizes.steps_per_update
        fingerprint = run_files.params_fingerprint(params)
        if args.save_model and self.is_main:
            try:
                model_path = run_files.save_model(args, params, self.dir, self.script_path)
            except OSError as error:
                self.write_failed("model file", error.filename, error)
            print(f"model saved to {model_path}")
        if args.eval_episodes and self.is_main:
            final = self.last_evaluation
            if final is None or final[0] != update:
                self.evaluate_and_log(update, params, optimizer_steps)
            eval_returns = self.last_evaluation[1]
            for episode, episode_return in enumerate(eval_returns):
                self.writer.add_scalar("eval/episodic_return", episode_return, episode)
            print(
                f"eval: mean return {np.mean(eval_returns):.1f} over {len(eval_returns)} episodes"
            )
        if self.is_main:
            summary = dict(
                params_fingerprint=fingerprint,
                global_step=global_step,
                learner_policy_version=update,
                sps=int(global_step / wall_time_s),
                wall_time_s=wall_time_s,
            )
            if self.evaluations:
                summary["eval_return"] = self.evaluations[-1][1]
                summary["eval_returns"] = self.evaluations
            self.write_json("summary.json", summary)
        upload_failure = None
        if args.upload_model and self.is_main:
            upload_failure = hub.upload_run(
                args,
                self.dir,
                self.script_path,
                model_path,
                card=self.model_card,
                eval_returns=self.last_evaluation[1] if args.eval_episodes else None,
                play=lambda episodes: self.evaluate(
                    params, args, episodes, args.seed + EVAL_SEED_OFFSET
                ),
                eval_seed=args.seed + EVAL_SEED_OFFSET,
                training_returns=list(self.recent_returns),
                global_step=global_step,
                params_fingerprint=fingerprint,
            )
        self.close_logs()
        self.end_if_events_failed()
        if args.track and self.is_main:
            import wandb

            try:
                wandb.finish()
            except Exception as error:
                # The run's own files hold its results: W&B's failure (a full disk) is one line.
                print(f"warning: W&B could not finish the run: {error}", file=sys.stderr)
        print(f"params_fingerprint={fingerprint}", flush=True)
        signals.ignore_stop_signals()
        if upload_failure is not None:
            print(upload_failure, file=sys.stderr, flush=True)
            sys.exit(hub.UPLOAD_FAILED_EXIT_CODE)


def open_run(
    args,
    sizes,
    script_path: str,
    counters: dict,
    global_learner_devices: list,
    *,
    evaluate,
    model_card=None,
    checkpointing: Checkpointing = FIRST_REPLICA,
) -> Run:
    """The run folder, its spec and its TensorBoard writer (and W&B with --track); process 0 alone
    writes. What the run needs of the script is given here, once: its `evaluate`, the
    `hub.ModelCard` of its --upload-model, and how its checkpoints are made
    (`checkpoints.Checkpointing`).
    `counters["update"] > 0` means a resumed run: it writes `spec_resume_<update>.json`, and
    TensorBoard drops what the preempted run logged after its checkpoint (purge_step), so the curves
    read as one stream."""
    backend = jax.default_backend()
    accelerators.check_opt_out(args, backend)
    name = (
        args.run_name
        or f"{name_part(args.env_id)}__{args.exp_name}__{args.seed}__{int(time.time())}"
    )
    run_dir = os.path.join("runs", name)
    resumed_update = counters["update"] or None
    is_main = jax.process_index() == 0
    if resumed_update:
        print(f"resuming {name} from update {resumed_update}")
    if is_main:
        spec_path = os.path.join(
            run_dir, f"spec_resume_{resumed_update}.json" if resumed_update else "spec.json"
        )
        try:
            os.makedirs(run_dir, exist_ok=True)
            run_files.write_json_atomically(
                spec_path, run_files.run_description(args, sizes, name, script_path)
            )
        except OSError as error:
            end_at_once(run_files.write_failure("run file", error.filename, error))
    if args.upload_model and is_main:
        hub.note_missing_token()
    if args.track and is_main:
        import wandb

        try:
            wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=dataclasses.asdict(args),
                name=name,
                group=args.group or None,
                save_code=True,
                id=name if args.resume else None,
                resume="allow" if args.resume else None,
            )
        except wandb.errors.Error as error:
            fail(
                f"--track could not start Weights & Biases ({str(error).splitlines()[0]}); log in "
                "with `wandb login`, or set WANDB_MODE=offline to log here and `wandb sync` later"
            )
    purge_step = resumed_update * sizes.steps_per_update + 1 if resumed_update else None
    evaluations = []
    evaluations_path = os.path.join(run_dir, EVALUATIONS_FILE)
    if resumed_update and os.path.exists(evaluations_path):
        # Like TensorBoard's: what the preempted run evaluated after its checkpoint is made again.
        with open(evaluations_path) as f:
            evaluations = [e for e in json.load(f) if e[0] < purge_step]
    # Flushed every few seconds (tensorboardX's default is 2 minutes): a search's pruner reads the
    # events while the run goes on.
    try:
        writer = SummaryWriter(run_dir, write_to_disk=is_main, purge_step=purge_step, flush_secs=5)
    except OSError as error:
        end_at_once(run_files.write_failure("TensorBoard events in", run_dir, error))
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n"
        + "\n".join(f"|{k}|{v}|" for k, v in dataclasses.asdict(args).items()),
    )
    num_local = sum(
        device.process_index == jax.process_index() for device in global_learner_devices
    )
    stop_agreed = signals.stop_agreement(global_learner_devices, num_local, args.distributed)
    run = Run(
        args=args,
        sizes=sizes,
        script_path=script_path,
        name=name,
        dir=run_dir,
        writer=writer,
        evaluate=evaluate,
        model_card=model_card,
        counters=counters,
        stop_agreed=stop_agreed,
        evaluations=evaluations,
        checkpointing=checkpointing,
    )
    guard_events(writer, run.note_events_failure)
    if is_main:
        print(
            f"{name}: {sizes.num_updates} update{'s' * (sizes.num_updates != 1)} of "
            f"{sizes.steps_per_update} environment steps "
            f"({sizes.num_envs} environments), {len(global_learner_devices)} learner device(s), "
            f"{jax.process_count()} process(es), JAX backend {backend}"
            f"{accelerators.backend_note(args, backend)}"
            f"{accelerators.platform_defaults_note(backend)}; a line at "
            f"least every {PROGRESS_SECONDS:.0f} s",
            flush=True,
        )
        run.progress_thread = threading.Thread(
            target=run.watch_progress, name="progress", daemon=True
        )
        run.progress_thread.start()
    return run


def end_at_once(line: str):
    """Ends the process with `line` and exit WRITE_FAILED_EXIT_CODE, before a run has started."""
    print(line, file=sys.stderr, flush=True)
    signals.end_process(WRITE_FAILED_EXIT_CODE)


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


def is_computed(tree) -> bool:
    """Whether every JAX array of `tree` has been computed (its other leaves are host values)."""
    return all(leaf.is_ready() for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array))


def wait_until_computed(tree):
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.block_until_ready()


@dataclasses.dataclass
class LoopEnd:
    """How the learner's loop ended: 0 when it ran to its last update, else the process's exit
    code."""

    exit_code: int = 0
