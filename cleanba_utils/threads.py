"""Threads that never hang: queue operations that give up once any thread has failed, and a runner
that turns a thread's exception into a stop of the whole process."""

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
