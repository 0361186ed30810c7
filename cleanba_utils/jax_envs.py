"""Environments written in JAX, with gymnax's interface: gymnax's own by id (`gymnax:CartPole-v1`,
`gymnax:Breakout-MinAtar`) and a researcher's own, named by the import path of a class or factory
(`jax:my_package.my_module:MyEnv`) that returns a `gymnax.environments.environment.Environment` (or
`(env, params)`). `--env-params NAME=VALUE` sets fields of the environment's parameters (MinAtar's
`max_steps_in_episode`, Pendulum's `max_torque`), and `sticky_action_prob=P` gives an environment
with discrete actions sticky actions (`StickyActions`: Young & Tian's MinAtar and Machado et al.'s
Atari protocol repeat the previous action with a probability, which gymnax's MinAtar does not).

`JaxVectorEnv` plays `num_envs` of them with envpool's conventions, so that every script takes
them as it takes envpool's environments:
- environment i of an instance made with seed s draws its keys from (s + i, step), as envpool seeds
  environment i with s + i: the run's environment g has the same keys whatever the layout;
- an episode's end is followed by a reset step, which ignores the action and returns the next
  episode's first observation with reward 0 (gymnax resets within the step that ends the episode:
  here the step gives the last observation and the next one resets, exactly as envpool does);
- termination and truncation as gymnax's `step_env` and `is_truncated` give them;
- images (height, width, channels) become channels first (channels, height, width), as envpool's
  Atari frames are; rewards are float32, observations float32 (uint8 images stay uint8).

Its `compiled()` step runs inside a script's compiled rollout (`compiled_rollout`): the
environments' state is an array tree that the rollout's `lax.scan` carries and a checkpoint holds.
The NumPy methods (`reset`, `step`, `send`, `recv`) call the same compiled step, for evaluation and
the actors that step in Python."""

import dataclasses
import functools
from typing import Any, NamedTuple

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np

from cleanba_utils.env_ids import GYMNAX_PREFIX, OWN_JAX_PREFIX, own_module
from cleanba_utils.errors import fail

ENV_KEY_STREAM = 0x656E76
"""Folded into each environment's key (`jax.random.PRNGKey(seed + i)`), so that its draws never
coincide with a script's, whose keys start from `PRNGKey(seed)` too."""


STICKY_ACTIONS = "sticky_action_prob"
"""The parameter of `--env-params` that Cleanba adds to every JAX environment with discrete actions
whose own parameters have no field of that name: the probability that a step repeats the previous
action (`StickyActions`)."""


class StickyState(NamedTuple):
    inner: Any
    """the wrapped environment's state"""
    last_action: Any
    """the action its last step took (0 after a reset)"""


@dataclasses.dataclass(frozen=True)
class StickyActions:
    """A gymnax environment whose every step takes, with probability `prob`, the action of the step
    before instead of the one given (Young & Tian's MinAtar: `sticky_action_prob` 0.1; Machado et
    al. (2018): 0.25 on Atari), drawn from the step's key. A reset forgets the last action (0)."""

    env: Any
    prob: float

    @property
    def default_params(self):
        return self.env.default_params

    def reset_env(self, key, params):
        obs, state = self.env.reset_env(key, params)
        return obs, StickyState(inner=state, last_action=jnp.int32(0))

    def step_env(self, key, state: StickyState, action, params):
        sticky_key, step_key = jax.random.split(key)
        repeat = jax.random.uniform(sticky_key) < self.prob
        action = jnp.where(repeat, state.last_action, action).astype(jnp.int32)
        obs, inner, reward, done, info = self.env.step_env(step_key, state.inner, action, params)
        return obs, StickyState(inner=inner, last_action=action), reward, done, info

    def is_truncated(self, state: StickyState, params):
        is_truncated = getattr(self.env, "is_truncated", None)
        return jnp.asarray(False) if is_truncated is None else is_truncated(state.inner, params)

    def action_space(self, params=None):
        return self.env.action_space(params)

    def observation_space(self, params):
        return self.env.observation_space(params)


def with_sticky_actions(env, params, settings: tuple[str, ...], env_id: str):
    """`(env, settings)`: the environment wrapped in `StickyActions` where `settings` hold
    `sticky_action_prob=P` (P > 0) and its own parameters no such field, the setting taken out."""
    own = [field.name for field in dataclasses.fields(params)]
    sticky = [s for s in settings if s.partition("=")[0] == STICKY_ACTIONS]
    if STICKY_ACTIONS in own or not sticky:
        return env, settings
    text = sticky[-1].partition("=")[2]
    try:
        prob = float(text)
    except ValueError:
        prob = float("nan")
    if not 0 <= prob < 1:
        fail(
            f"--env-params {sticky[-1]}: {STICKY_ACTIONS} is a probability of repeating the "
            "previous action, at least 0 and below 1"
        )
    if not hasattr(env.action_space(params), "n"):
        fail(
            f"--env-params {sticky[-1]}: {env_id} has continuous actions; sticky actions repeat a "
            "discrete one"
        )
    kept = tuple(s for s in settings if s.partition("=")[0] != STICKY_ACTIONS)
    return (StickyActions(env, prob) if prob > 0 else env), kept


class JaxEnv(NamedTuple):
    env: Any
    """the gymnax `Environment`"""
    params: Any
    """its parameters (gymnax's `EnvParams`), with --env-params applied"""


def _own_env(path: str):
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        fail(
            f"--env-id {OWN_JAX_PREFIX}{path} is not an import path: write "
            f"{OWN_JAX_PREFIX}package.module:ClassOrFactory"
        )
    module = own_module(f"{OWN_JAX_PREFIX}{path}", module_name)
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        fail(f"--env-id {OWN_JAX_PREFIX}{path}: {module_name} has no class or factory {attribute}")
    made = factory()
    env, params = made if isinstance(made, tuple) else (made, None)
    missing = [
        name
        for name in ("reset_env", "step_env", "default_params", "action_space", "observation_space")
        if not hasattr(env, name)
    ]
    if missing:
        fail(
            f"--env-id {OWN_JAX_PREFIX}{path} is not an environment with gymnax's interface: it "
            f"lacks {', '.join(missing)} (subclass gymnax.environments.environment.Environment)"
        )
    return env, env.default_params if params is None else params


def _parsed(text: str, default):
    if isinstance(default, bool) or isinstance(getattr(default, "item", lambda: None)(), bool):
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
        raise ValueError(text)
    if isinstance(default, int | np.integer) or jnp.issubdtype(jnp.asarray(default).dtype, int):
        return int(text)
    value = float(text)
    if not np.isfinite(value):
        raise ValueError(text)
    return value


def with_params(params, settings: tuple[str, ...], env_id: str):
    """`params` with each NAME=VALUE of `settings` set, the value read as the field's type."""
    names = [field.name for field in dataclasses.fields(params)]
    for setting in settings:
        name, equals, text = setting.partition("=")
        if not equals:
            fail(f"--env-params takes NAME=VALUE, got {setting}")
        if name not in names:
            fail(
                f"--env-params {setting}: {env_id} has no parameter {name}; it has "
                f"{', '.join(names)}, and {STICKY_ACTIONS} where its actions are discrete"
            )
        try:
            value = _parsed(text, getattr(params, name))
        except ValueError:
            fail(
                f"--env-params {setting}: {text} is not a finite value of {name}'s type "
                f"(default {getattr(params, name)})"
            )
        params = params.replace(**{name: value})
    return params


@functools.cache
def load_env(env_id: str, settings: tuple[str, ...] = ()) -> JaxEnv:
    """The environment of a `gymnax:` or `jax:` id, with --env-params `settings`; one line and exit
    2 for an unknown id or an unusable environment."""
    if env_id.startswith(GYMNAX_PREFIX):
        import gymnax

        name = env_id[len(GYMNAX_PREFIX) :]
        if name not in gymnax.registered_envs:
            fail(
                f"--env-id {env_id}: gymnax has no environment {name}; it has "
                f"{', '.join(gymnax.registered_envs)}"
            )
        env, params = gymnax.make(name)
    else:
        env, params = _own_env(env_id[len(OWN_JAX_PREFIX) :])
    env, settings = with_sticky_actions(env, params, tuple(settings), env_id)
    return JaxEnv(env, with_params(params, settings, env_id))


def _gymnasium_space(space) -> gymnasium.Space:
    """A gymnax space as the gymnasium space envpool would give (Discrete or Box)."""
    if hasattr(space, "n"):
        return gymnasium.spaces.Discrete(int(space.n), dtype=np.int32)
    if hasattr(space, "low") and hasattr(space, "shape"):
        shape = tuple(space.shape)
        low = np.broadcast_to(np.asarray(space.low, np.float32), shape)
        high = np.broadcast_to(np.asarray(space.high, np.float32), shape)
        return gymnasium.spaces.Box(low, high, shape, np.float32)
    raise TypeError(type(space).__name__)


def action_space(env: JaxEnv) -> gymnasium.Space:
    try:
        return _gymnasium_space(env.env.action_space(env.params))
    except TypeError as error:
        fail(f"the environment's action space {error} is neither discrete nor a box of reals")


def _is_image(shape) -> bool:
    return len(shape) == 3


def observation_space(env: JaxEnv) -> gymnasium.Space:
    """The observations as `JaxVectorEnv` gives them: images channels first."""
    space = env.env.observation_space(env.params)
    shape = tuple(space.shape)
    if len(shape) not in (1, 3):
        fail(
            f"the environment observes arrays of shape {shape}; the scripts take vectors or "
            "images (height, width, channels)"
        )
    dtype = np.uint8 if np.dtype(getattr(space, "dtype", np.float32)) == np.uint8 else np.float32
    if _is_image(shape):
        shape = (shape[2], shape[0], shape[1])
    low, high = (0, 255) if dtype == np.uint8 else (-np.inf, np.inf)
    return gymnasium.spaces.Box(
        np.full(shape, low, dtype), np.full(shape, high, dtype), shape, dtype
    )


class EnvsState(NamedTuple):
    """The state of a batch of environments, environment first on every leaf: what a compiled
    rollout carries from step to step and a checkpoint holds."""

    env_state: Any
    """gymnax's state of each environment"""
    obs: Any
    """the observation to act on next"""
    next_is_reset: Any
    """whether the next step is a reset step (the last one ended an episode)"""
    episode_return: Any
    """the return of each environment's current (or just ended) episode, counted on the device"""
    episode_length: Any
    """its steps"""
    seeds: Any
    """each environment's seed (seed + i: its keys)"""


def _boundary_obs(obs, dtype):
    obs = jnp.asarray(obs)
    if obs.ndim == 4:
        obs = jnp.transpose(obs, (0, 3, 1, 2))
    return obs.astype(dtype)


def compiled(env: JaxEnv):
    """`(reset(seeds), step(state, actions, step_index))`, pure functions of arrays for a compiled
    program: `reset` gives the `EnvsState` of freshly reset environments of those seeds; `step`
    plays one step of every environment (a reset step where `next_is_reset`) with the keys of their
    seeds and `step_index`, the step of the run (policy step: 0, 1, …), and returns `(state,
    observations, rewards, terminations, truncations)`."""
    obs_dtype = observation_space(env).dtype
    gymnax_env, params = env.env, env.params
    is_truncated = getattr(gymnax_env, "is_truncated", None)
    env_key = lambda seed: jax.random.fold_in(jax.random.PRNGKey(seed), ENV_KEY_STREAM)

    def reset(seeds):
        # A fresh environment's first reset draws with the key of step -1 (folded as 2**32 - 1).
        keys = jax.vmap(lambda s: jax.random.fold_in(env_key(s), jnp.uint32(2**32 - 1)))(seeds)
        obs, env_state = jax.vmap(gymnax_env.reset_env, in_axes=(0, None))(keys, params)
        return EnvsState(
            env_state=env_state,
            obs=_boundary_obs(obs, obs_dtype),
            next_is_reset=jnp.zeros(seeds.shape, bool),
            episode_return=jnp.zeros(seeds.shape, jnp.float32),
            episode_length=jnp.zeros(seeds.shape, jnp.int32),
            seeds=seeds,
        )

    def step_one(key, env_state, action, is_reset):
        step_key, reset_key = jax.random.split(key)
        obs, stepped, reward, terminated, _ = gymnax_env.step_env(
            step_key, env_state, action, params
        )
        truncated = jnp.asarray(False) if is_truncated is None else is_truncated(stepped, params)
        reset_obs, reset_state = gymnax_env.reset_env(reset_key, params)
        pick = lambda when_reset, when_stepped: jax.tree.map(
            lambda r, s: jnp.where(is_reset, r, s), when_reset, when_stepped
        )
        return (
            pick(reset_state, stepped),
            pick(reset_obs, obs),
            jnp.where(is_reset, 0.0, reward).astype(jnp.float32),
            ~is_reset & jnp.asarray(terminated, bool),
            ~is_reset & jnp.asarray(truncated, bool),
        )

    def step(state: EnvsState, actions, step_index):
        keys = jax.vmap(lambda s: jax.random.fold_in(env_key(s), step_index))(state.seeds)
        env_state, obs, rewards, terminations, truncations = jax.vmap(step_one)(
            keys, state.env_state, actions, state.next_is_reset
        )
        obs = _boundary_obs(obs, obs_dtype)
        playing = ~state.next_is_reset
        state = EnvsState(
            env_state=env_state,
            obs=obs,
            next_is_reset=terminations | truncations,
            episode_return=jnp.where(playing, state.episode_return + rewards, 0.0),
            episode_length=jnp.where(playing, state.episode_length + 1, 0),
            seeds=state.seeds,
        )
        return state, obs, rewards, terminations, truncations

    return reset, step


class JaxVectorEnv:
    """`num_envs` environments of a `gymnax:` or `jax:` id with envpool's interface (`reset`,
    `step`, `send`/`recv`, `action_space`, `observation_space`, `close`), environment i seeded with
    `seed + i`. The step index of its keys counts this instance's steps from 0, as a run's policy
    steps do."""

    def __init__(self, env_id: str, settings: tuple[str, ...], seed: int, num_envs: int):
        self.env = load_env(env_id, tuple(settings))
        self.action_space = action_space(self.env)
        self.observation_space = observation_space(self.env)
        self.num_envs = num_envs
        self.seeds = np.arange(seed, seed + num_envs, dtype=np.uint32)
        reset, step = compiled(self.env)
        self._reset = jax.jit(reset)
        self._step = jax.jit(step)
        self.state = None
        self.steps = 0
        self._sent = None

    def reset(self):
        self.state = self._reset(self.seeds)
        self.steps = 0
        return np.asarray(self.state.obs), {}

    def step(self, actions):
        actions = np.asarray(actions, self.action_space.dtype)
        self.state, obs, rewards, terminations, truncations = self._step(
            self.state, actions, np.uint32(self.steps)
        )
        self.steps += 1
        info = {"env_id": np.arange(self.num_envs, dtype=np.int32)}
        return (
            np.asarray(obs),
            np.asarray(rewards),
            np.asarray(terminations),
            np.asarray(truncations),
            info,
        )

    def send(self, actions):
        self._sent = actions

    def recv(self):
        return self.step(self._sent)

    def close(self):
        self.state = None
