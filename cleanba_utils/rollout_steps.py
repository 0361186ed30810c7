"""What an actor thread's rollout gives back, whichever way its environments step: envpool's in
Python beside the policy's inference (`split_envs.start_splits`), or the policy's and the
environments' steps in one compiled program (`compiled_rollout.start`: every JAX environment, and
envpool's MuJoCo and dm_control tasks for the continuous scripts). Both take the script's policy
step `act(params, obs, env_ids, step, step_input) -> (env_actions, outputs)` and count the
episodes. A network with a recurrent core (`cores`) acts with its state as well: given the
environments' first state (`core_state`), a rollout calls `act(params, obs, env_ids, step,
step_input, core_state, is_reset) -> (env_actions, outputs, core_state)`, `is_reset` the step's
reset steps, and carries the state from step to step and rollout to rollout."""

from typing import Any, NamedTuple

import numpy as np


class Steps(NamedTuple):
    """Steps of an actor thread's environments, env-major (envs, steps, ...): rollouts' steps join
    along axis 1."""

    obs: Any
    """the observations acted on (on the host, or, where envpool's environments step in Python, on
    the actor's device, where inference put them)"""
    env_actions: np.ndarray
    """the actions the environments received"""
    outputs: Any
    """the policy step's own outputs (`act`'s second result), on the host"""
    rewards: np.ndarray
    """raw, as the environments give them (Atari: clipped, as envpool gives them for learning)"""
    terminations: np.ndarray
    truncations: np.ndarray
    is_reset: np.ndarray
    """reset steps: the step after an episode's end ignores the action and returns the next
    episode's first observation (envpool's; a JAX environment's as `jax_envs` maps them)"""


class EpisodeEnd(NamedTuple):
    """An episode that ended in the rollout: its return is logged as `charts/episodic_return`;
    a script may log it again under its own key (Ape-X DQN's lowest ε, GALA's agents)."""

    global_step: int
    env: int
    """the environment's index among the actor thread's"""
    episode_return: float


class PlayedRollout(NamedTuple):
    """One rollout of an actor thread's environments."""

    steps: Steps
    next_obs: Any
    """(envs, ...) the observation after the rollout's last step"""
    bootstrap_value: Any
    """the script's `bootstrap(params, next_obs)` (PPO: the critic's value of the observation
    after the last step, which bootstraps the returns), None where it gives none"""
    record: Any
    """the environments' record after the rollout (a copy, which later rollouts leave alone), for
    the scripts whose checkpoints bring the environments back; else None"""
    episode_ends: list[EpisodeEnd]
    inference_time: float
    """seconds in the policy's step where it runs apart from the environments' (0 where both run
    in one compiled program)"""
    env_step_time: float
    """seconds stepping the environments (in one compiled program: the policy's steps too)"""
    first_core_state: Any = None
    """the recurrent core's state (`cores`) that the rollout's first step met, from which the
    learner replays each environment's steps; None without a core"""
    next_core_state: Any = None
    """the core's state after the rollout's last step, which the next rollout's first step meets
    (a checkpoint holds it, on the host); None without a core"""
