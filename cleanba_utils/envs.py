"""The environments as every script makes them, from their source: envpool's by id (`Breakout-v5`,
`HalfCheetah-v4`), JAX environments by `gymnax:` or `jax:` id (`jax_envs`). Which tasks are Atari
games and which have continuous actions or image observations, the Atari protocol of Machado et
al. (2018), how many worker threads an envpool instance gets, the flat observations of the
continuous-control scripts, and the environments' step for compiled rollouts."""

import os
import warnings

import envpool
import jax.numpy as jnp
import numpy as np

from cleanba_utils import gymnasium_envs, jax_envs
from cleanba_utils.env_ids import is_gymnasium_env, is_jax_env

# gymnasium warns at every start that the CartPole spaces' float64 bounds become float32: nothing
# for a user to act on.
warnings.filterwarnings("ignore", message=r".*precision lowered by casting to float32")

MACHADO_ATARI = dict(
    repeat_action_probability=0.25,
    full_action_space=True,
    episodic_life=False,
    noop_max=1,
    max_episode_steps=27_000,
    reward_clip=True,
)
"""Sticky actions, the full action space, no life-loss signal, one no-op at reset at most, 108k
frames (27k agent steps) per episode at most, rewards clipped to their sign for learning (the
logged returns are unclipped)."""


def task_spaces(env_id: str, settings: tuple[str, ...] = ()):
    """(observation space, action space) of the task, as the scripts' environments give them."""
    if is_jax_env(env_id):
        env = jax_envs.load_env(env_id, tuple(settings))
        return jax_envs.observation_space(env), jax_envs.action_space(env)
    if is_gymnasium_env(env_id):
        return gymnasium_envs.spaces(env_id)
    spec = envpool.make_spec(env_id)
    return spec.observation_space, spec.action_space


def action_space_of(args):
    """The action space of --env-id with --env-params (a JAX environment's bounds may depend on its
    parameters)."""
    return task_spaces(args.env_id, tuple(args.env_params))[1]


def is_atari(env_id: str) -> bool:
    """envpool's Atari tasks are the ones whose config has sticky actions."""
    if is_jax_env(env_id) or is_gymnasium_env(env_id):
        return False
    return "repeat_action_probability" in envpool.make_spec(env_id).config._fields


def envpool_num_threads(requested: int | None, num_envs: int, instances: int) -> int:
    """Worker threads of one of `instances` envpool instances that share this process's CPUs: the
    `requested` number, else an equal share of the CPUs (at least 1, at most one per environment).
    The results never depend on it."""
    if requested:
        return requested
    # sched_getaffinity counts the CPUs this process may use (a SLURM allocation), not the node's.
    cpus_per_instance = len(os.sched_getaffinity(0)) // instances
    return max(1, min(num_envs, cpus_per_instance))


def make_env(args, seed: int, num_envs: int):
    """`num_envs` gymnasium environments of --env-id for a script with actor threads, environment i
    seeded with `seed + i`. One envpool instance per actor thread (--num-actor-threads on each
    actor device), its worker threads as `envpool_num_threads` shares the CPUs among them; an actor
    thread's splits (--env-splits, of which one steps at a time) each get that share. Atari
    follows Machado et al. (2018) (`MACHADO_ATARI`); a MuJoCo or dm_control episode ends on
    termination or at the task's time limit (1000 steps), which envpool reports as a truncation.
    A JAX environment (`gymnax:` or `jax:` id) is a `jax_envs.JaxVectorEnv` with --env-params; a
    Gymnasium environment (`gymnasium:` id) a `gymnasium_envs.GymnasiumVectorEnv` in
    --vectorization-mode, its images stacked by --frame-stack."""
    if is_jax_env(args.env_id):
        return jax_envs.JaxVectorEnv(args.env_id, args.env_params, seed, num_envs)
    if is_gymnasium_env(args.env_id):
        return gymnasium_envs.GymnasiumVectorEnv(
            args.env_id, seed, num_envs, args.vectorization_mode, getattr(args, "frame_stack", 1)
        )
    instances = args.num_actor_threads * len(args.actor_device_ids)
    options = MACHADO_ATARI if is_atari(args.env_id) else {}
    return envpool.make(
        args.env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        seed=seed,
        num_threads=envpool_num_threads(args.envpool_num_threads, num_envs, instances),
        **options,
    )


def is_continuous(env_id: str) -> bool:
    """Tasks whose actions are vectors of reals (MuJoCo, dm_control), not the index of a choice."""
    return np.issubdtype(task_spaces(env_id)[1].dtype, np.floating)


def has_image_observations(env_id: str) -> bool:
    """Tasks observed as stacked frames (channels, height, width), as Atari's: the tasks a CNN torso
    is for."""
    return len(getattr(task_spaces(env_id)[0], "shape", None) or ()) == 3


def observation_size(env_id: str) -> int:
    """The features of a `flat_observation` of the task: of every key of dm_control's dict
    observations."""
    space = task_spaces(env_id)[0]
    spaces = space.spaces.values() if hasattr(space, "spaces") else [space]
    return sum(int(np.prod(s.shape)) for s in spaces)


def flat_observation(obs, xp=np):
    """float32 (envs, features). dm_control tasks observe a dict of arrays: their features are
    concatenated in sorted key order. `xp`: NumPy, or jax.numpy inside a compiled program."""
    if isinstance(obs, dict):
        return xp.concatenate(
            [xp.asarray(obs[key], xp.float32).reshape(len(obs[key]), -1) for key in sorted(obs)],
            axis=1,
        )
    return xp.asarray(obs, xp.float32)


def needs_x64(envs) -> bool:
    """envpool's MuJoCo and dm_control tasks take float64 actions and give float64 observations and
    rewards: their compiled step is made and called with 64-bit types on (`jax.enable_x64(True)`,
    which holds for the calling thread only). A JAX environment computes in its own types."""
    return not isinstance(envs, jax_envs.JaxVectorEnv)


def compiled_step(envs):
    """The environments' step for a rollout compiled as one program: returns their handle and
    `step(handle, actions, step_index) -> (handle, observations, rewards, terminations,
    truncations)`, `step_index` the run's policy step. envpool's through its XLA interface
    (`envs.xla()`, with 64-bit types on: `needs_x64`), the actions cast to the task's action type,
    the observations flat float32 as `flat_observation` gives them; a JAX environment's handle is
    its `jax_envs.EnvsState` after `reset` (or a checkpoint's)."""
    if isinstance(envs, jax_envs.JaxVectorEnv):
        _, step_jax_envs = jax_envs.compiled(envs.env)
        action_dtype = envs.action_space.dtype
        return envs.state, lambda state, actions, step_index: step_jax_envs(
            state, actions.astype(action_dtype), step_index
        )
    handle, _, _, step_envs = envs.xla()
    # envpool's XLA step takes its own environments' indices, 0 .. num_envs - 1.
    own_env_ids = np.arange(envs.config["num_envs"], dtype=np.int32)
    action_dtype = envs.action_space.dtype

    def step(handle, actions, step_index):
        handle, (obs, rewards, terminations, truncations, _) = step_envs(
            handle, actions.astype(action_dtype), own_env_ids
        )
        return handle, flat_observation(obs, jnp), rewards, terminations, truncations

    return handle, step
