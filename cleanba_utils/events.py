"""Scalars from the TensorBoard event files that the training scripts write into their run folders."""

from pathlib import Path
from typing import NamedTuple

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

EPISODIC_RETURN = "charts/episodic_return"


class Scalars(NamedTuple):
    """One tag's values in step order; wall times are seconds since the run's first event."""

    steps: np.ndarray
    wall_times: np.ndarray
    values: np.ndarray


def read_scalars(run_dir: Path, tag: str = EPISODIC_RETURN) -> Scalars:
    """The values of `tag` in `run_dir` (none yet: empty arrays). Purging (the default) drops what a preempted
    run logged after the checkpoint it resumed from; several actor threads log out of step order, hence the sort."""
    if not Path(run_dir).is_dir():
        return Scalars(np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return Scalars(np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    logged = sorted(events.Scalars(tag), key=lambda event: event.step)
    start = events.FirstEventTimestamp()
    return Scalars(
        steps=np.array([event.step for event in logged], np.int64),
        wall_times=np.array([event.wall_time - start for event in logged]),
        values=np.array([event.value for event in logged], np.float64),
    )


def running_mean(values, n: int) -> np.ndarray:
    """Mean of the last `n` values (fewer at the start) at every position."""
    sums = np.concatenate([[0.0], np.cumsum(values)])
    end = np.arange(1, len(values) + 1)
    return (sums[end] - sums[np.maximum(end - n, 0)]) / np.minimum(end, n)
