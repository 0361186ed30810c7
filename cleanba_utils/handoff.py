"""What the learner and its actor threads hand each other: parameters down the param queues,
rollouts up the rollout queues, and the Cleanba rule that every rollout is checked against, the
policy lag.

The rule: with --concurrency an actor skips its parameter fetch on its second rollout, so from then
on it plays with the policy one version behind the learner's (lag 1); without it, actor and learner
take turns (lag 0). The policy of version v is the learner's after v updates: the rollout of update
u is played by version u - 1, or u - 2 from the second rollout on with --concurrency.

A session's `LagRule`, given once when its actor threads start, holds the rule: the actors fetch by
it and the learner checks each update's rollouts against it (`ActorThreads.take_rollouts`).

A resumed run (its first update `first_update` > 1) goes on in one of two ways, `on_resume`:
- "restart_lag": as a new run from the checkpoint's parameters: lag 0 for its first rollout, then
  1. The scripts whose resumed environments start anew (PPO, IMPALA, Ape-X DQN, GALA A2C on
  envpool's environments).
- "keep_lag": as the uninterrupted run, lag 1 across the resume: the learner first sends the
  parameters that played the checkpoint's next rollout (version first_update - 2), and the actor
  fetches before each rollout from then on. The scripts that resume bit for bit (SAC, continuous
  PPO, Ape-X DPG; every script on a JAX environment)."""

import dataclasses
import queue
import threading
import time
from typing import Literal, NamedTuple

import jax

from cleanba_utils.threads import queue_get, queue_put, start_thread

OnResume = Literal["restart_lag", "keep_lag"]


class ActorTimes(NamedTuple):
    """An actor thread's seconds for one rollout, handed up with it: the learner logs each measured
    one (not None) as stats/<name>, its mean over the update's rollouts."""

    param_queue_get_time: float
    """waiting for parameters before the rollout (0 where the actor skipped its fetch)"""
    rollout_time: float | None = None
    """playing the rollout and making its data"""
    inference_time: float | None = None
    """in the policy's step, where it runs apart from the environments' (`rollout_steps`)"""
    env_step_time: float | None = None
    """stepping the environments (in one compiled program: the policy's steps too)"""


def send_params(params, policy_version: int, actor_devices: list, param_queues: list, stop):
    """Puts `(policy_version, params)` on every param queue. The queues are grouped by actor device
    in `actor_devices` order; the host copy `params` is put on each device once and shared by its
    threads."""
    threads_per_device = len(param_queues) // len(actor_devices)
    for device_index, actor_device in enumerate(actor_devices):
        on_device = jax.device_put(params, actor_device)
        first = device_index * threads_per_device
        for param_queue in param_queues[first : first + threads_per_device]:
            queue_put(param_queue, (policy_version, on_device), stop)


@dataclasses.dataclass(frozen=True)
class LagRule:
    """The rule of this session's updates, given once when the actor threads start: the updates
    `first_update` .. `num_updates`, --concurrency and what a resume does (`on_resume`)."""

    first_update: int
    num_updates: int
    concurrency: bool
    on_resume: OnResume

    def updates(self) -> range:
        """The updates this session makes (none for a finished run)."""
        return range(self.first_update, self.num_updates + 1)

    def lag_start(self) -> int:
        """The update whose rollout the lag counts from: the session's first, or the run's."""
        return self.first_update if self.on_resume == "restart_lag" else 1

    def actor_fetches_params(self, update: int) -> bool:
        """Whether the actor takes parameters from its param queue before playing the rollout of
        `update`: always, but for the rollout after the lag's start with --concurrency."""
        if update == self.first_update:
            return True
        return not (self.concurrency and update == self.lag_start() + 1)

    def expected_policy_lag(self, update: int) -> int:
        """The policy lag of the data of `update`: 1 with --concurrency after the lag's start,
        else 0."""
        return 1 if self.concurrency and update > self.lag_start() else 0

    def check(self, rollouts: list, update: int):
        """Raises if a rollout is not the one of `update` or was played by a policy other than the
        one the rule prescribes: which policy made which data must never depend on timing. Each
        rollout has the fields `update` and `policy_version`; the learner is at version
        `update - 1`."""
        learner_policy_version = update - 1
        expected = self.expected_policy_lag(update)
        for rollout in rollouts:
            lag = learner_policy_version - rollout.policy_version
            if rollout.update != update or lag != expected:
                raise RuntimeError(
                    f"update {update}: rollout {rollout.update} from policy "
                    f"{rollout.policy_version} while the learner is at {learner_policy_version} "
                    f"(lag {lag}, expected {expected})"
                )


@dataclasses.dataclass
class ActorThreads:
    """This process's actor threads, in global environment order, with their queues and the lag
    rule they keep."""

    rollout_queues: list
    threads: list
    param_queues: list
    actor_devices: list
    stop: threading.Event
    lag: LagRule
    last_sent: object = None
    """the host copy of the parameters sent last: with --concurrency they play the actors' next
    rollout, which a "keep_lag" script's checkpoint holds (`kept_lag`)"""

    def send(self, params, policy_version: int):
        """Puts the parameters on every param queue (`send_params`) and remembers them."""
        send_params(params, policy_version, self.actor_devices, self.param_queues, self.stop)
        self.last_sent = params

    def send_first(self, params, acting_params=None):
        """What the learner sends before its first update: with --concurrency a resumed
        "keep_lag" run first sends `acting_params`, the checkpoint's parameters that play the
        actors' next rollout (version first_update - 2), then the learner's own `params` (version
        first_update - 1). A run whose checkpoint holds no acting parameters (None:
        "restart_lag") sends its learner's alone."""
        lag = self.lag
        resumed = lag.first_update > 1
        if (
            resumed
            and lag.concurrency
            and lag.first_update <= lag.num_updates
            and acting_params is not None
        ):
            self.send(acting_params, lag.first_update - 2)
        self.send(params, lag.first_update - 1)

    def take_rollouts(self, update: int) -> tuple[list, float]:
        """The rollouts of `update` (`take_rollouts`)."""
        return take_rollouts(self.rollout_queues, update, self.lag, self.stop)


def take_rollouts(rollout_queues: list, update: int, lag: LagRule, stop) -> tuple[list, float]:
    """The rollouts of `update`, one from each rollout queue, checked against the lag rule, and
    the seconds the learner waited for them."""
    wait_start = time.time()
    rollouts = [queue_get(rollout_queue, stop) for rollout_queue in rollout_queues]
    waited = time.time() - wait_start
    lag.check(rollouts, update)
    return rollouts, waited


def start_actor_threads(
    actor_thread,
    actor_devices: list,
    *,
    args,
    run,
    lag: LagRule,
    threads_per_device: int | None = None,
    **shared,
) -> ActorThreads:
    """Starts `threads_per_device` threads (default --num-actor-threads) on each of this process's
    `actor_devices` (a device may be listed more than once: GALA's agents that share it), each
    with its own param queue and rollout queue of max size 1 (the Cleanba architecture): the thread
    of global index i runs `actor_thread(args=args, run=run, lag=lag, env_offset=i *
    --local-num-envs, device=…, param_queue=…, rollout_queue=…, **shared)`, named actor-i; it plays
    the global environments env_offset .. env_offset + --local-num-envs - 1, the updates of `lag`.
    A thread that fails ends the run (`threads.start_thread`)."""
    threads_per_device = threads_per_device or args.num_actor_threads
    num_threads = len(actor_devices) * threads_per_device
    first_thread = jax.process_index() * num_threads
    param_queues = [queue.Queue(maxsize=1) for _ in range(num_threads)]
    rollout_queues = [queue.Queue(maxsize=1) for _ in range(num_threads)]
    threads = [
        start_thread(
            target=actor_thread,
            name=f"actor-{first_thread + index}",
            stop=run.stop,
            failures=run.failures,
            args=args,
            run=run,
            lag=lag,
            env_offset=(first_thread + index) * args.local_num_envs,
            device=actor_devices[index // threads_per_device],
            param_queue=param_queues[index],
            rollout_queue=rollout_queues[index],
            **shared,
        )
        for index in range(num_threads)
    ]
    return ActorThreads(
        rollout_queues=rollout_queues,
        threads=threads,
        param_queues=param_queues,
        actor_devices=actor_devices,
        stop=run.stop,
        lag=lag,
    )
