"""What the learner and its actor threads hand each other: parameters down the param queues,
rollouts up the rollout queues, and the Cleanba rule that every rollout is checked against, the
policy lag.

The rule: with --concurrency an actor skips its parameter fetch on its second rollout, so from then
on it plays with the policy one version behind the learner's (lag 1); without it, actor and learner
take turns (lag 0). The policy of version v is the learner's after v updates: the rollout of update
u is played by version u - 1, or u - 2 from the second rollout on with --concurrency.

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
from typing import Literal

import jax

from cleanba_utils.threads import queue_get, queue_put, start_thread

OnResume = Literal["restart_lag", "keep_lag"]


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


@dataclasses.dataclass
class ActorThreads:
    """This process's actor threads, in global environment order, with their queues."""

    rollout_queues: list
    threads: list
    param_queues: list
    actor_devices: list
    stop: threading.Event
    last_sent: object = None
    """the host copy of the parameters sent last: with --concurrency they play the actors' next
    rollout, which a "keep_lag" script's checkpoint holds (`kept_lag`)"""

    def send(self, params, policy_version: int):
        """Puts the parameters on every param queue (`send_params`) and remembers them."""
        send_params(params, policy_version, self.actor_devices, self.param_queues, self.stop)
        self.last_sent = params


def start_actor_threads(actor_thread, actor_devices: list, *, args, run, **shared) -> ActorThreads:
    """Starts --num-actor-threads threads on each of this process's `actor_devices`, each with its
    own param queue and rollout queue of max size 1 (the Cleanba architecture): the thread of global
    index i runs `actor_thread(args=args, run=run, env_offset=i * --local-num-envs, device=…,
    param_queue=…, rollout_queue=…, **shared)`, named actor-i; it plays the global environments
    env_offset .. env_offset + --local-num-envs - 1. A thread that fails ends the run
    (`threads.start_thread`)."""
    num_threads = len(actor_devices) * args.num_actor_threads
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
            env_offset=(first_thread + index) * args.local_num_envs,
            device=actor_devices[index // args.num_actor_threads],
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
    )


def lag_start(first_update: int, on_resume: OnResume) -> int:
    """The update whose rollout the lag counts from: the session's first, or the run's."""
    return first_update if on_resume == "restart_lag" else 1


def actor_fetches_params(
    update: int, first_update: int, concurrency: bool, on_resume: OnResume
) -> bool:
    """Whether the actor takes parameters from its param queue before playing the rollout of
    `update`: always, but for the rollout after the lag's start with --concurrency."""
    if update == first_update:
        return True
    return not (concurrency and update == lag_start(first_update, on_resume) + 1)


def expected_policy_lag(
    update: int, first_update: int, concurrency: bool, on_resume: OnResume
) -> int:
    """The policy lag of the data of `update`: 1 with --concurrency after the lag's start, else
    0."""
    return 1 if concurrency and update > lag_start(first_update, on_resume) else 0


def check_policy_lag(
    rollouts: list, update: int, first_update: int, concurrency: bool, on_resume: OnResume
):
    """Raises if a rollout is not the one of `update` or was played by a policy other than the one
    the rule prescribes: which policy made which data must never depend on timing. Each rollout has
    the fields `update` and `policy_version`; the learner is at version `update - 1`."""
    learner_policy_version = update - 1
    expected = expected_policy_lag(update, first_update, concurrency, on_resume)
    for rollout in rollouts:
        lag = learner_policy_version - rollout.policy_version
        if rollout.update != update or lag != expected:
            raise RuntimeError(
                f"update {update}: rollout {rollout.update} from policy {rollout.policy_version} "
                f"while the learner is at {learner_policy_version} (lag {lag}, expected {expected})"
            )


def take_rollouts(
    rollout_queues: list,
    update: int,
    first_update: int,
    concurrency: bool,
    on_resume: OnResume,
    stop,
) -> tuple[list, float]:
    """The rollouts of `update`, one from each rollout queue, checked against the rule
    (`check_policy_lag`), and the seconds the learner waited for them."""
    wait_start = time.time()
    rollouts = [queue_get(rollout_queue, stop) for rollout_queue in rollout_queues]
    waited = time.time() - wait_start
    check_policy_lag(
        rollouts,
        update=update,
        first_update=first_update,
        concurrency=concurrency,
        on_resume=on_resume,
    )
    return rollouts, waited


def send_first_params(
    actors: ActorThreads,
    params,
    acting_params,
    first_update: int,
    num_updates: int,
    concurrency: bool,
):
    """What the learner sends before its first update: with --concurrency a resumed "keep_lag" run
    first sends `acting_params`, the checkpoint's parameters that play the actors' next rollout
    (version first_update - 2), then the learner's own `params` (version first_update - 1). A run
    whose checkpoint holds no acting parameters (`acting_params` None: "restart_lag") sends its
    learner's alone."""
    resumed = first_update > 1
    if resumed and concurrency and first_update <= num_updates and acting_params is not None:
        actors.send(acting_params, first_update - 2)
    actors.send(params, first_update - 1)
