"""The sizes of a run that plays every environment the same number of steps per learner update:
its environments, the environment steps of one update and the number of updates."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sizes:
    num_envs: int
    """the environments of the whole run (every actor thread of every process)"""
    steps_per_update: int
    """environment steps of one learner update: num_envs x num_steps"""
    num_updates: int
    """the learner updates of the run: --total-timesteps // steps_per_update"""


def rollout_sizes(num_envs: int, num_steps: int, total_timesteps: int) -> Sizes:
    steps_per_update = num_envs * num_steps
    return Sizes(
        num_envs=num_envs,
        steps_per_update=steps_per_update,
        num_updates=total_timesteps // steps_per_update,
    )
