"""How --env-id names an environment and its source, and the names made from it. Imports nothing
of the package but `errors`, so that every module (the option checks before JAX is imported among
them) can use it.

- `Breakout-v5`, `CartPole-v1`, `HalfCheetah-v4`: envpool's task of that id;
- `gymnax:<id>`: gymnax's environment of that id (`gymnax:Breakout-MinAtar`, `gymnax:Pendulum-v1`);
- `jax:<module>:<name>`: a researcher's own JAX environment with gymnax's interface, the class or
  factory `<name>` of the importable module `<module>` (`jax:my_package.envs:GridWorld`);
- `gymnasium:<id>`: Gymnasium's registered environment (`gymnasium:CartPole-v1`, and Gymnasium's
  `module:Env-v0` form), or `gymnasium:<module>:<name>` a researcher's own Gymnasium environment
  class or factory (`gymnasium:my_package.envs:MyEnv`)."""

import importlib
import re

from cleanba_utils.errors import fail

GYMNAX_PREFIX = "gymnax:"
OWN_JAX_PREFIX = "jax:"
GYMNASIUM_PREFIX = "gymnasium:"

ENV_ID_SCHEME = (
    "an envpool id (Breakout-v5, CartPole-v1, HalfCheetah-v4), gymnax:<id> "
    "(gymnax:Breakout-MinAtar, gymnax:Pendulum-v1), jax:<module>:<class or factory>, "
    "gymnasium:<id> (gymnasium:CartPole-v1) or gymnasium:<module>:<class or factory>"
)


def is_jax_env(env_id: str) -> bool:
    """A JAX environment (`cleanba_utils.jax_envs`), stepped inside the actor's compiled rollout."""
    return env_id.startswith((GYMNAX_PREFIX, OWN_JAX_PREFIX))


def is_gymnasium_env(env_id: str) -> bool:
    """A Gymnasium environment (`cleanba_utils.gymnasium_envs`), stepped in Python."""
    return env_id.startswith(GYMNASIUM_PREFIX)


def is_envpool_env(env_id: str) -> bool:
    return not is_jax_env(env_id) and not is_gymnasium_env(env_id)


def name_part(env_id: str) -> str:
    """The id as a part of a folder's or a Hugging Face repository's name: every character other
    than letters, digits, `.`, `_` and `-` (a source's `:`, a path's `/`) becomes `-`
    (`gymnax:Breakout-MinAtar` -> `gymnax-Breakout-MinAtar`)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", env_id)


def own_module(env_id: str, module_name: str):
    """The module that --env-id `env_id` names for a researcher's own environment; one line and
    exit 2 where it does not import."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        fail(
            f"--env-id {env_id}: cannot import {module_name} ({error}); is it on PYTHONPATH or "
            "installed?"
        )
