"""The bitwise resume of the scripts whose policy lag goes on across a resume (`handoff`'s
"keep_lag": SAC, continuous PPO and Ape-X DPG, and every script on a JAX environment). Their
checkpoint holds, beside the learner, what the uninterrupted run plays next: the parameters sent
last (with --concurrency they play the actors' next rollout), every environment's record (its
resets and its current episode, `env_records`, or a JAX environment's state, from which
`compiled_rollout.start` brings the environments back), the replay with its priorities not yet
written, and what the actor threads carry from one rollout into the next (continuous PPO's
discounted returns, the Ape-X scripts' n-step tails).

A script gives `run_origin` the templates of its learner state, its acting parameters and its
actors' carry, and gets back where the run starts (`Origin`); at the end of each update it hands
`Run.after_update` a `Continuation`, whose host copy (`Origin.checkpointing`) is the checkpoint."""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import numpy as np

from cleanba_utils import env_records
from cleanba_utils.checkpoints import FIRST_REPLICA, Checkpointing, resume_or_start
from cleanba_utils.devices import first_replica
from cleanba_utils.env_records import EnvRecord
from cleanba_utils.replay.prioritized_learning import NO_PENDING, PendingPriorities
from cleanba_utils.replay.store import ReplayStore


class Continuation(NamedTuple):
    """How the run goes on from the end of an update, which a "keep_lag" script hands
    `Run.after_update`: the learner and all that the uninterrupted run plays next. Its host copy
    (`on_host`) is what the checkpoint holds; the saved keys are its fields' names."""

    learner: Any
    """the learner's state: replicated on the learner devices (the checkpoint: its first replica)"""
    acting_params: Any
    """the parameters sent last (`handoff.ActorThreads.last_sent`), on the host"""
    env_record: EnvRecord
    """every environment's record after the update's rollouts, in global env order"""
    replay: Any = None
    """the replay's `Mark` at the update's end (the checkpoint: the replay as it was there, or an
    empty replay's where the script has none or does not save it)"""
    pending_priorities: PendingPriorities | None = None
    """a prioritized replay's call whose priorities are not written yet (the checkpoint: its TD
    errors on the host, or `NO_PENDING`)"""
    actor_carry: Any = ()
    """what the actor threads carry from one rollout into the next besides the environments, on
    the host (continuous PPO's discounted returns, the Ape-X scripts' n-step tails)"""


def on_host(kept: Continuation, replay: ReplayStore | None, empty_replay: dict) -> Continuation:
    """The checkpoint of `kept`: the learner's first replica, the replay at its mark (`replay`
    None: `empty_replay`) and the pending TD errors on the host."""
    pending = NO_PENDING
    if replay is not None and kept.pending_priorities is not None:
        pending = kept.pending_priorities._replace(
            td=np.asarray(jax.device_get(first_replica(kept.pending_priorities.td)))
        )
    return kept._replace(
        learner=first_replica(kept.learner),
        replay=empty_replay if replay is None else replay.snapshot_at(kept.replay),
        pending_priorities=pending,
    )


class Origin(NamedTuple):
    """Where a "keep_lag" run starts: from scratch (the None fields) or from its newest
    checkpoint."""

    learner: Any
    """the learner's state on the host: the checkpoint's, or the template"""
    counters: dict
    """what `open_run` takes (`checkpoints.resume_or_start`)"""
    acting_params: Any
    """the parameters of the actors' next rollout (`handoff.ActorThreads.send_first`), or None"""
    env_record: EnvRecord | None
    """every environment's record, which the actor threads continue from, or None"""
    pending_priorities: PendingPriorities | None
    """the checkpoint's pending priorities, their TD errors on the host, or None (none pending)"""
    actor_carry: Any
    """the actors' carry, or None"""
    checkpointing: Checkpointing
    """how `Run` makes a checkpoint of a `Continuation` (`open_run`'s `checkpointing`)"""


def learner_origin(learner, counters: dict) -> Origin:
    """Where a run starts with its learner alone, nothing else to bring back: a fresh run, or a
    "restart_lag" run resumed (a script that keeps only its learner across a resume, as PPO on
    envpool's environments), its checkpoints the learner's first replica."""
    return Origin(
        learner=learner,
        counters=counters,
        acting_params=None,
        env_record=None,
        pending_priorities=None,
        actor_carry=None,
        checkpointing=FIRST_REPLICA,
    )


def run_origin(
    args,
    sizes,
    script_path: str,
    learner,
    acting_params,
    actor_carry=(),
    replay: ReplayStore | None = None,
    save_replay: bool = True,
) -> Origin:
    """With --resume and a checkpoint, the run's state at it, the replay restored; else a fresh
    start. `learner`, `acting_params` and `actor_carry` are templates of the saved structure (the
    fresh run's values); the checkpoint holds the replay where `save_replay`. A resume must match
    the global sizes and the seed."""
    empty_replay = {} if replay is None else replay.snapshot()
    template = Continuation(
        learner=learner,
        acting_params=acting_params,
        env_record=env_records.empty_record(sizes.num_envs, args.env_id, args.env_params),
        replay=empty_replay,
        pending_priorities=NO_PENDING,
        actor_carry=actor_carry,
    )
    identity = dict(sizes=dataclasses.asdict(sizes), seed=args.seed)
    saved, counters = resume_or_start(args, template, identity, script_path)
    saved_on_host = functools.partial(
        on_host, replay=replay if save_replay else None, empty_replay=empty_replay
    )
    checkpointing = Checkpointing(
        on_host=saved_on_host, frozen_by=() if replay is None else (replay.lock,)
    )
    if saved is None:
        return learner_origin(learner, counters)._replace(checkpointing=checkpointing)
    if replay is not None:
        replay.restore(saved.replay)
    pending = None
    if len(saved.pending_priorities.slots):
        pending = saved.pending_priorities._replace(inserted=int(saved.pending_priorities.inserted))
    return Origin(
        learner=saved.learner,
        counters=counters,
        acting_params=saved.acting_params,
        env_record=saved.env_record,
        pending_priorities=pending,
        actor_carry=saved.actor_carry,
        checkpointing=checkpointing,
    )
