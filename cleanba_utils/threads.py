"""Threads that never hang: queue operations that give up once any thread has failed, a runner that
turns a thread's exception into a stop of the whole process, and `BackgroundJobs`, one thread that
runs submitted functions in order (the replay's work while a learner update runs)."""

import queue
import threading
import traceback

POLL_SECONDS = 0.2


class Stopped(Exception):
    """Raised in a thread blocked on a queue when the run is stopping (another thread failed or the
    learner finished); the thread then ends quietly."""


def queue_get(q: queue.Queue, stop: threading.Event):
    while True:
        try:
            return q.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if stop.is_set():
                raise Stopped from None


def queue_put(q: queue.Queue, item, stop: threading.Event):
    while True:
        try:
            return q.put(item, timeout=POLL_SECONDS)
        except queue.Full:
            if stop.is_set():
                raise Stopped from None


def start_thread(
    target, name: str, stop: threading.Event, failures: list[str], **kwargs
) -> threading.Thread:
    """Runs `target(**kwargs)` in a daemon thread; an exception is recorded in `failures` and sets
    `stop`, so that every other thread leaves its queue wait and the process ends with the failure.
    """

    def guarded():
        try:
            target(**kwargs)
        except Stopped:
            pass
        except BaseException:
            failures.append(traceback.format_exc())
            stop.set()

    thread = threading.Thread(target=guarded, name=name, daemon=True)
    thread.start()
    return thread


class Job:
    """A function submitted to `BackgroundJobs`, and its result once `done` is set."""

    def __init__(self, function):
        self.function = function
        self.done = threading.Event()
        self.result = None


class BackgroundJobs:
    """Runs functions in one daemon thread, one at a time in the order they were submitted. The
    thread is started with `threads.start_thread`: an exception in a job stops the run (`stop` set,
    the traceback in `failures`), and a learner waiting for a job raises `Stopped` within a poll
    interval."""

    def __init__(self, name: str, stop: threading.Event, failures: list):
        self.stop = stop
        self.jobs = queue.Queue()
        self.thread = start_thread(target=self.work, name=name, stop=stop, failures=failures)

    def work(self):
        while True:
            job = queue_get(self.jobs, self.stop)
            job.result = job.function()
            job.done.set()

    def submit(self, function) -> Job:
        """Queues `function()` after every job submitted before."""
        job = Job(function)
        self.jobs.put(job)
        return job

    def wait(self, job: Job):
        """The result of `job`, once it has run."""
        while not job.done.wait(POLL_SECONDS):
            if self.stop.is_set():
                raise Stopped
        return job.result
