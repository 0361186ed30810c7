"""n-step transitions of env-major rollouts, as the Ape-X learners store them: the return of up to n
rewards, the discount and the offset of the bootstrap observation, and which steps start one."""

import numpy as np


def n_step_transitions(rewards, terminations, truncations, is_reset, gamma: float, n: int):
    """Transitions of steps 0 .. L - 1 of env-major windows (envs, L + n): the return of up to n
    rewards, the bootstrap's discount (0 after a termination, gamma ** offset otherwise, truncations
    included) and offset. None spans two episodes; envpool's reset steps (after an episode's end;
    the action is ignored) are not valid."""
    length = rewards.shape[1] - n
    returns = np.zeros((len(rewards), length), np.float32)
    offsets = np.full((len(rewards), length), n, np.uint8)
    open_ = np.ones(returns.shape, bool)
    terminated = np.zeros(returns.shape, bool)
    for k in range(n):
        returns += open_ * np.float32(gamma**k) * rewards[:, k : k + length]
        ends = open_ & (terminations[:, k : k + length] | truncations[:, k : k + length])
        offsets[ends] = k + 1
        terminated |= open_ & terminations[:, k : k + length]
        open_ &= ~ends
    discounts = np.where(terminated, 0.0, np.float32(gamma) ** offsets).astype(np.float32)
    return returns, discounts, offsets, ~is_reset[:, :length]
