"""Scalars from the TensorBoard event files that the training scripts write into their run folders,
and the learning curves made of them."""

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

EPISODIC_RETURN = "charts/episodic_return"
EVAL_RETURN = "charts/eval_return"  # the mean return of an evaluation during training
OPT_STEP = "charts/opt_step"  # the optimizer steps so far, logged with each evaluation
BY_EPISODE = ("eval/episodic_return",)  # logged against the episode's number, not a global step
GRID_POINTS = 100  # of every grid that learning curves are put on for averaging and plotting


class Scalars(NamedTuple):
    """One tag's values in step order; wall times are seconds of the run's own sessions since its
    first event, without the time between a stop and the --resume that continued it."""

    steps: np.ndarray
    wall_times: np.ndarray
    values: np.ndarray


def read_scalars(run_dir: Path, tag: str = EPISODIC_RETURN) -> Scalars:
    """The values of `tag` in `run_dir` (none yet: empty arrays); see `read_tags`."""
    return read_tags(run_dir, (tag,))[tag]


def read_tags(run_dir: Path, tags) -> dict[str, Scalars]:
    """{tag: its values in `run_dir`} for each of `tags` (none yet: empty arrays). Every session
    of a run (the first, then each --resume) writes its own event file. A resumed session repeats
    the steps after its checkpoint, so what an earlier session logged from the first global step
    the resumed one logged on is dropped (the final evaluation's episodes, BY_EPISODE, are numbered
    from 0 and say nothing of it). Several actor threads log out of step order, hence the sort."""
    sessions = []
    for path in Path(run_dir).glob("events.out.tfevents.*"):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        if events.Tags()["scalars"]:
            sessions.append(events)
    logged_by_tag = {tag: ([], [], []) for tag in tags}  # steps, wall times, values
    sessions_time = 0.0  # the run time of the earlier sessions
    for events in sorted(sessions, key=lambda events: events.FirstEventTimestamp()):
        names = events.Tags()["scalars"]
        start = events.FirstEventTimestamp()
        logged = [event for name in names for event in events.Scalars(name)]
        global_steps = [
            event.step for name in names if name not in BY_EPISODE for event in events.Scalars(name)
        ]
        first_step = min(global_steps, default=math.inf)
        for tag, (steps, wall_times, values) in logged_by_tag.items():
            kept = [i for i, step in enumerate(steps) if step < first_step]
            steps[:] = [steps[i] for i in kept]
            wall_times[:] = [wall_times[i] for i in kept]
            values[:] = [values[i] for i in kept]
            for event in events.Scalars(tag) if tag in names else []:
                steps.append(event.step)
                wall_times.append(sessions_time + event.wall_time - start)
                values.append(event.value)
        sessions_time += max(event.wall_time for event in logged) - start
    result = {}
    for tag, (steps, wall_times, values) in logged_by_tag.items():
        order = np.argsort(steps, kind="stable")
        result[tag] = Scalars(
            steps=np.array(steps, np.int64)[order],
            wall_times=np.array(wall_times, np.float64)[order],
            values=np.array(values, np.float64)[order],
        )
    return result


def running_mean(values, n: int) -> np.ndarray:
    """Mean of the last `n` values (fewer at the start) at every position."""
    sums = np.concatenate([[0.0], np.cumsum(values)])
    end = np.arange(1, len(values) + 1)
    return (sums[end] - sums[np.maximum(end - n, 0)]) / np.minimum(end, n)
