"""What the learner and its actor threads hand each other: parameters down the param queues,
rollouts up the rollout queues, and the Cleanba rule that every rollout is checked against, the
policy lag."""

import jax

from cleanba_utils.threads import queue_put


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


def expected_policy_lag(concurrency: bool, update: int, first_update: int) -> int:
    """The policy lag of the data of `update`: with --concurrency the actor skips its parameter
    fetch on its second rollout, so from then on it plays with the policy one version behind the
    learner's; otherwise (and on a run's or a resumed run's first update) it plays with the current
    one."""
    return 1 if concurrency and update > first_update else 0


def check_policy_lag(
    rollouts: list, update: int, learner_policy_version: int, concurrency: bool, first_update: int
):
    """Raises if a rollout is not the one of `update` or was played by a policy other than the one
    the protocol prescribes: which policy made which data must never depend on timing. Each rollout
    has the fields `update` and `policy_version`."""
    expected = expected_policy_lag(concurrency, update, first_update)
    for rollout in rollouts:
        lag = learner_policy_version - rollout.policy_version
        if rollout.update != update or lag != expected:
            raise RuntimeError(
                f"update {update}: rollout {rollout.update} from policy {rollout.policy_version} "
                f"while the learner is at {learner_policy_version} (lag {lag}, expected {expected})"
            )
