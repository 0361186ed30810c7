"""What brings an actor's environments back to where a checkpoint left them. envpool's MuJoCo and
dm_control simulations are deterministic given their seed and the actions, so per environment it
suffices to know how often it was reset since it was made (each reset draws the next initial state)
and the actions of its current episode: a resumed actor makes its environments with the same
seeds, resets each as often, and replays its current episode (`fast_forward`).

Not for Atari: with sticky actions an emulator draws a random number at every step, so only the
whole history of actions since the environment was made would bring it back (docs/checkpoints.md,
"What a resumed run is", says what a resumed Atari run is).

Gymnasium's environments are brought back the same way (`GymnasiumVectorEnv.restore`) where they
have a time limit, which bounds the episode a record holds: exactly where their steps draw no random
numbers (Gymnasium's MuJoCo tasks; an environment whose steps draw from its `np_random` would
replay its current episode with other draws, as the draws of the episodes before are not replayed).
Without a time limit the record holds no actions (`kept`), and a resumed run makes the environments
anew from the run's seeds.

A JAX environment's record is its state itself (`jax_envs.EnvsState`, on the host): an array tree
that a checkpoint holds whole and a resumed actor takes back as it was."""

from typing import NamedTuple

import envpool
import jax
import numpy as np

from cleanba_utils import gymnasium_envs, jax_envs
from cleanba_utils.env_ids import is_gymnasium_env, is_jax_env
from cleanba_utils.envs import flat_observation


class EnvRecord(NamedTuple):
    """Per environment: the resets since the first, and the actions of its current episode."""

    resets: np.ndarray
    episode_actions: np.ndarray
    """(envs, max episode steps, action dims); the first `episode_lengths` steps are played (the
    actions the environment received)"""
    episode_lengths: np.ndarray


def empty_record(
    num_envs: int, env_id: str, env_params: tuple[str, ...] = ()
) -> EnvRecord | jax_envs.EnvsState:
    """The record of `num_envs` environments of `env_id` (with --env-params `env_params`) before
    any step: the template of a checkpoint's."""
    if is_jax_env(env_id):
        reset, _ = jax_envs.compiled(jax_envs.load_env(env_id, tuple(env_params)))
        shapes = jax.eval_shape(reset, jax.ShapeDtypeStruct((num_envs,), np.uint32))
        return jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), shapes)
    if is_gymnasium_env(env_id):
        action_space = gymnasium_envs.spaces(env_id)[1]
        max_steps = gymnasium_envs.episode_cap(env_id) or 0
    else:
        spec = envpool.make_spec(env_id)
        action_space = spec.action_space
        max_steps = spec.config.max_episode_steps
    return EnvRecord(
        resets=np.zeros(num_envs, np.int64),
        episode_actions=np.zeros((num_envs, max_steps, *(action_space.shape or (1,))), np.float32),
        episode_lengths=np.zeros(num_envs, np.int64),
    )


def kept(record: EnvRecord) -> bool:
    """Whether the record can bring its environments back: it holds their episodes' actions (a
    Gymnasium environment without a time limit has none)."""
    return record.episode_actions.shape[1] > 0


def record_step(record: EnvRecord, actions, is_reset):
    """Adds one step to `record` (in place): a reset step (envpool's step after an episode's end,
    which ignores the action) starts a new episode, any other step adds its action to its
    episode. A JAX environment's record is its state, which the rollout gives whole."""
    if isinstance(record, jax_envs.EnvsState) or not kept(record):
        return
    record.resets[:] += is_reset
    record.episode_lengths[is_reset] = 0
    playing = np.flatnonzero(~is_reset)
    record.episode_actions[playing, record.episode_lengths[playing]] = actions[playing]
    record.episode_lengths[playing] += 1


def copy_of(record):
    """A copy that later steps leave alone (what a rollout hands the learner)."""
    return jax.tree.map(np.array, record)


def part(record, envs: slice):
    """The record of some of the environments (a copy)."""
    return jax.tree.map(lambda field: np.array(field[envs]), record)


def fast_forward(envs, record: EnvRecord, on_step=None):
    """Brings freshly made `envs` (made with the seeds of those that `record` describes) to the
    state of `record`: each environment is reset as often as it was, then replays its current
    episode's actions (alone: envpool steps a subset of its environments). `on_step(env_ids,
    reward, terminated, truncated)` sees each replayed step, for the actor's running sums (episode
    returns, discounted returns). Returns the current observation and which environments' next
    step is a reset step (an episode that ended on the record's last step). A JAX environment
    takes its recorded state back."""
    if isinstance(record, jax_envs.EnvsState):
        envs.state = jax.device_put(record)
        return np.asarray(record.obs), np.asarray(record.next_is_reset)
    if isinstance(envs, gymnasium_envs.GymnasiumVectorEnv):
        return _brought_back_gymnasium(envs, record, on_step)
    obs = flat_observation(envs.reset()[0])
    for env, resets in enumerate(record.resets):
        for _ in range(resets):
            obs[env] = flat_observation(envs.reset(np.array([env]))[0])[0]
    next_is_reset = np.zeros(len(obs), bool)
    for step in range(record.episode_lengths.max(initial=0)):
        ids = np.flatnonzero(record.episode_lengths > step)
        step_obs, reward, terminated, truncated, info = envs.step(
            record.episode_actions[ids, step], ids
        )
        stepped = info["env_id"]
        obs[stepped] = flat_observation(step_obs)
        next_is_reset[stepped] = terminated | truncated
        if on_step is not None:
            on_step(stepped, reward, terminated, truncated)
    return obs, next_is_reset


def _brought_back_gymnasium(envs, record: EnvRecord, on_step):
    """`fast_forward` of Gymnasium's environments: each brought back in its own process or worker
    (`GymnasiumVectorEnv.restore`), the replayed steps shown to `on_step` afterwards, environment
    by environment. A record that holds no actions (`kept`) makes them anew."""
    if not kept(record):
        return envs.reset()[0], np.zeros(envs.num_envs, bool)
    actions = [
        record.episode_actions[env, :length].reshape(length, *envs.action_space.shape)
        for env, length in enumerate(record.episode_lengths)
    ]
    obs, ended, rewards = envs.restore(record.resets, actions)
    if on_step is not None:
        for env, replayed in enumerate(rewards):
            for step, reward in enumerate(replayed):
                last = step == len(replayed) - 1
                on_step(
                    np.array([env]),
                    np.array([reward]),
                    np.array([last and ended[env]]),
                    np.array([False]),
                )
    return obs, ended
