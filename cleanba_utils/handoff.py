"""What the learner and its actor threads hand each other: parameters down the param queues,
rollouts up the rollout queues, and the Cleanba rule that every rollout is checked against, the
policy lag.

The rule: with --concurrency an actor skips its parameter fetch on its second rollout, so from then
on it plays with the policy one version behind the learner's (lag 1); without it, actor and learner
take turns (lag 0). The policy of version v is the learner's after v updates: the rollout of update
u is played by version u - 1, or u - 2 from the second rollout on with --concurrency.

A resumed run (its first update `first_update` > 1) goes on in one of two ways, `on_resume`:
- "restart_lag": as a new run from the checkpoint's parameters: lag 0 for its first rollout, then
  1. The scripts whose resumed environments start anew (PPO, IMPALA, Ape-X DQN, GALA A2C).
- "keep_lag": as the uninterrupted run, lag 1 across the resume: the learner first sends the
  parameters that played the checkpoint's next rollout (version first_update - 2), and the actor
  fetches before each rollout from then on. The scripts that resume bit for bit (SAC, continuous
  PPO, Ape-X DPG)."""

from typing import Literal

import jax

from cleanba_utils.threads import queue_put

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
