"""A learner's optimizer steps on a prioritized replay (Ape-X's): calls of K steps on batches drawn
beforehand, whose TD errors become priorities one call later, the replay's work in one background
thread in one fixed order, so that the run never depends on timing."""

import functools
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from cleanba_utils.devices import first_replica
from cleanba_utils.replay.store import ReplayStore
from cleanba_utils.threads import BackgroundJobs

PRIORITY_EPSILON = 1e-6  # keeps a transition with zero TD error sampleable


class Sampled(NamedTuple):
    """The batches of one learner call ready for the learner devices, and what their priority update
    needs."""

    shards: Any
    """this process's learner devices' shares (device, step, transition; Ape-X DQN's, one step a
    call: device, transition), with the importance weights as the field `weights`"""
    slots: np.ndarray
    """(step, transition), or (transition)"""
    inserted: int
    """the transitions inserted before the batches were sampled"""
    seconds: float


class PendingPriorities(NamedTuple):
    """A learner call whose priorities are not written yet: its batches' slots, the number of
    transitions inserted before they were sampled, and the TD errors (steps, batch): a device array,
    maybe still being computed."""

    slots: np.ndarray
    inserted: int
    td: Any


NO_PENDING = PendingPriorities(slots=np.zeros(0, np.int64), inserted=0, td=np.zeros(0, np.float32))


class Learned(NamedTuple):
    """The optimizer steps of one learner update: the last call's losses, and `stats`: the
    importance weights of its last batch and the seconds spent sampling and writing priorities."""

    metrics: dict
    stats: dict


def write_priorities(replay: ReplayStore, pending: PendingPriorities) -> float:
    """Waits for the call's TD errors and writes |TD| + PRIORITY_EPSILON as their transitions'
    priorities (not those evicted since the sample); a transition drawn by several of the call's
    steps gets the last one's. Returns the seconds spent writing."""
    td = np.asarray(jax.device_get(first_replica(pending.td))).ravel()
    tic = time.time()
    slots = pending.slots.ravel()
    _, last_from_end = np.unique(slots[::-1], return_index=True)
    last = len(slots) - 1 - last_from_end
    replay.update_priorities(
        slots[last], np.abs(td[last]) + PRIORITY_EPSILON, sampled_at=pending.inserted
    )
    return time.time() - tic


def learn(
    args,
    jobs: BackgroundJobs,
    replay: ReplayStore,
    state,
    update_fn,
    sample,
    first_step: int,
    pending,
    steps_per_call: int,
):
    """--updates-per-rollout optimizer steps from `first_step`, in calls of K = `steps_per_call`
    (Ape-X DPG's --steps-per-call; Ape-X DQN's 1): `update_fn(state, shards) -> (state, metrics,
    td)` on the `Sampled` of `sample(step)`, the batches of steps step .. step + K - 1, with the
    learner devices first and the K steps next where K > 1. The replay's work runs in `jobs`, in one
    fixed order: the K batches of call c + 1 are drawn after the priorities of call c - 1 are
    written into `replay` and before those of call c (across updates too: `pending` is the last
    call's). So a step's TD errors reach the sampler K to 2K - 1 steps late: K = 1 is a one-step
    lag. With --pipeline, call c + 1's batches are sampled and call c - 1's priorities written while
    call c runs; without, the learner waits for them. The order, and so the run, is the same either
    way. Returns the state, the `Learned` (the importance weights of the last step's batch) and the
    new `pending`."""
    last = first_step + args.updates_per_rollout
    next_batches = jobs.submit(functools.partial(sample, first_step))
    writes = []
    sample_seconds = 0.0
    for call_start in range(first_step, last, steps_per_call):
        sampled = jobs.wait(next_batches)
        sample_seconds += sampled.seconds
        submitted = []
        if pending is not None:
            writes.append(jobs.submit(functools.partial(write_priorities, replay, pending)))
            submitted.append(writes[-1])
        if call_start + steps_per_call < last:
            next_batches = jobs.submit(functools.partial(sample, call_start + steps_per_call))
            submitted.append(next_batches)
        if not args.pipeline:
            for job in submitted:
                jobs.wait(job)
        state, metrics, td = update_fn(state, sampled.shards)
        if not args.pipeline:
            jax.block_until_ready(td)
        pending = PendingPriorities(slots=sampled.slots, inserted=sampled.inserted, td=td)
    weights = sampled.shards.weights
    last_weights = weights.reshape(len(weights), steps_per_call, -1)[:, -1]
    stats = dict(
        is_weight_min=float(last_weights.min()),
        is_weight_max=float(last_weights.max()),
        replay_time=sample_seconds + sum(jobs.wait(write) for write in writes),
    )
    learned = Learned(metrics=metrics, stats=stats)
    return state, learned, pending


def log_priorities(run, update: int, read_priorities, priority_exponent: float):
    """Every --log-frequency updates and after the last: the mean and the maximum of the replay's
    priorities (`read_priorities()`, an O(N) pass) as stats/priority_mean and stats/priority_max,
    where sampling follows them (priority_exponent > 0)."""
    if update % run.args.log_frequency and update != run.sizes.num_updates:
        return
    priorities = read_priorities()
    if priorities.size and priority_exponent:
        run.logs.log(
            {"stats/priority_mean": priorities.mean(), "stats/priority_max": priorities.max()},
            update * run.sizes.steps_per_update,
        )
