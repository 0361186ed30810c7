"""Gymnasium's environments as a source of environments (`--env-id gymnasium:<id>`): a registered id
(`gymnasium:CartPole-v1`, `gymnasium:HalfCheetah-v5`, gymnasium's own `module:Env-v0` form that
imports the module registering it) or a researcher's own environment class or factory with
Gymnasium's interface, named by its import path (`gymnasium:my_package.envs:MyEnv`).

`GymnasiumVectorEnv` plays `num_envs` of them, stepped one after another in this process
(Gymnasium's `SyncVectorEnv`), with envpool's interface and conventions, so that the scripts whose
actors step their environments in Python (PPO, IMPALA, Ape-X DQN, GALA-A2C) take them as they take
envpool's:
- environment i of an instance made with seed s is reset with seed s + i, as envpool seeds its
  environment i: the run's environment g is the same whatever the layout;
- an episode's end is followed by a reset step, which ignores the action and returns the next
  episode's first observation with reward 0 and no end: Gymnasium's `NEXT_STEP` autoreset is
  envpool's reset step, taken as it is;
- termination and truncation (a `TimeLimit`) as the environment gives them;
- observations float32 (uint8 images stay uint8), images (height, width, channels) channels first
  as envpool's Atari frames are; rewards float32; discrete actions int32.

A researcher's own class is checked first by Gymnasium's `env_checker`."""

import functools
import importlib
import warnings

import gymnasium
import numpy as np
from gymnasium.utils.env_checker import check_env

from cleanba_utils.env_ids import GYMNASIUM_PREFIX
from cleanba_utils.errors import fail


def _own_factory(env_id: str):
    """The class or factory a `gymnasium:<module>:<name>` id names, or None where the id is one for
    `gymnasium.make` (one line and exit 2 where the module does not import)."""
    name = env_id[len(GYMNASIUM_PREFIX) :]
    module_name, colon, attribute = name.partition(":")
    if colon:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            fail(
                f"--env-id {env_id}: cannot import {module_name} ({error}); is it on PYTHONPATH "
                "or installed?"
            )
        own = getattr(module, attribute, None)
        if callable(own) and not isinstance(own, str):
            return own
    return None


def _factory(env_id: str):
    """A function that makes one environment of the id."""
    own = _own_factory(env_id)
    name = env_id[len(GYMNASIUM_PREFIX) :]
    return own if own is not None else lambda: gymnasium.make(name)


def _made(env_id: str):
    try:
        env = _factory(env_id)()
    except (gymnasium.error.Error, ImportError, ModuleNotFoundError) as error:
        fail(f"--env-id {env_id}: Gymnasium cannot make it ({type(error).__name__}: {error})")
    if not isinstance(env, gymnasium.Env):
        fail(
            f"--env-id {env_id} makes a {type(env).__name__}, not a gymnasium.Env (reset, step, "
            "action_space, observation_space)"
        )
    return env


def _action_space(space, env_id: str) -> gymnasium.Space:
    if isinstance(space, gymnasium.spaces.Discrete) and int(space.start) == 0:
        return gymnasium.spaces.Discrete(int(space.n), dtype=np.int32)
    if isinstance(space, gymnasium.spaces.Box) and len(space.shape) == 1:
        return gymnasium.spaces.Box(
            space.low.astype(np.float32), space.high.astype(np.float32), space.shape, np.float32
        )
    fail(
        f"--env-id {env_id} acts in {space}; the scripts take Discrete(n) from 0 or a Box of "
        "reals (a vector)"
    )


def _observation_space(space, env_id: str) -> gymnasium.Space:
    if not isinstance(space, gymnasium.spaces.Box) or len(space.shape) not in (1, 3):
        fail(
            f"--env-id {env_id} observes {space}; the scripts take a Box of a vector or of an "
            "image (height, width, channels): flatten a Dict or Tuple space with Gymnasium's "
            "FlattenObservation wrapper in your factory"
        )
    dtype = np.uint8 if space.dtype == np.uint8 else np.float32
    shape = tuple(space.shape)
    if len(shape) == 3:
        shape = (shape[2], shape[0], shape[1])
    low, high = (0, 255) if dtype == np.uint8 else (-np.inf, np.inf)
    return gymnasium.spaces.Box(
        np.full(shape, low, dtype), np.full(shape, high, dtype), shape, dtype
    )


@functools.cache
def spaces(env_id: str) -> tuple[gymnasium.Space, gymnasium.Space]:
    """(observation space, action space) as `GymnasiumVectorEnv` gives them; one line and exit 2 for
    an id Gymnasium cannot make or spaces the scripts cannot take."""
    env = _made(env_id)
    try:
        taken = (
            _observation_space(env.observation_space, env_id),
            _action_space(env.action_space, env_id),
        )
    finally:
        env.close()
    if _own_factory(env_id) is not None:
        # A researcher's own class then meets Gymnasium's checker (its seeding, the types its reset
        # and step return); what it finds, or an error of the class's own, is one line.
        env = _made(env_id)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check_env(env, skip_render_check=True)
        except Exception as error:
            fail(
                f"--env-id {env_id} fails Gymnasium's environment checker: "
                f"{type(error).__name__}: {error}"
            )
        finally:
            env.close()
    return taken


def _boundary_obs(obs, space: gymnasium.Space):
    obs = np.asarray(obs)
    if obs.ndim == 4:
        obs = np.transpose(obs, (0, 3, 1, 2))
    return np.ascontiguousarray(obs, space.dtype)


class GymnasiumVectorEnv:
    """`num_envs` environments of a `gymnasium:` id with envpool's interface (`reset`, `step`,
    `send`/`recv`, `action_space`, `observation_space`, `close`), environment i reset with seed
    `seed + i`."""

    def __init__(self, env_id: str, seed: int, num_envs: int):
        self.observation_space, self.action_space = spaces(env_id)
        factory = _factory(env_id)
        self.envs = gymnasium.vector.SyncVectorEnv(
            [factory] * num_envs, autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP
        )
        self.num_envs = num_envs
        self.seed = seed
        self.env_ids = np.arange(num_envs, dtype=np.int32)
        self._sent = None

    def reset(self):
        obs, _ = self.envs.reset(seed=self.seed)
        return _boundary_obs(obs, self.observation_space), {"env_id": self.env_ids.copy()}

    def step(self, actions):
        actions = np.asarray(actions).astype(self.envs.single_action_space.dtype)
        obs, rewards, terminations, truncations, _ = self.envs.step(actions)
        info = {"env_id": self.env_ids.copy()}
        return (
            _boundary_obs(obs, self.observation_space),
            np.asarray(rewards, np.float32),
            np.asarray(terminations, bool),
            np.asarray(truncations, bool),
            info,
        )

    def send(self, actions):
        self._sent = actions

    def recv(self):
        return self.step(self._sent)

    def close(self):
        self.envs.close()
