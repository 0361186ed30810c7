"""The episodes of a script's `evaluate`: one whole episode in each of a batch of fresh
environments, played by the script's evaluation policy."""

import numpy as np


def ended(terminated, truncated, info):
    """An episode ends when it terminates or is truncated."""
    return terminated | truncated


def carrying_state(step, state):
    """`act(obs, step)` for `play_episodes` from a policy with a state (a recurrent core's):
    `step(obs, step, state) -> (actions, state)`, each step's state carried into the next, from
    `state`."""

    def act(obs, t):
        nonlocal state
        actions, state = step(obs, t, state)
        return actions

    return act


def play_episodes(envs, num_episodes: int, act, episode_over=ended) -> list[float]:
    """Plays one episode in each of the `num_episodes` environments of `envs`, the actions
    `act(obs, step)`; returns their unclipped returns (envpool's `info["reward"]` where it clips),
    each counted until `episode_over(terminated, truncated, info)`. Closes `envs` (made for these
    episodes: their worker threads end with them)."""
    try:
        obs, _ = envs.reset()
        returns = np.zeros(num_episodes)
        finished = np.zeros(num_episodes, dtype=bool)
        step = 0
        while not finished.all():
            obs, reward, terminated, truncated, info = envs.step(np.asarray(act(obs, step)))
            returns += info.get("reward", reward) * ~finished
            finished |= episode_over(terminated, truncated, info)
            step += 1
        return returns.tolist()
    finally:
        envs.close()
