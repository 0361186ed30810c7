"""How --env-id names an environment and its source, and the names made from it. Imports nothing,
so that every module (the option checks before JAX is imported among them) can use it.

- `Breakout-v5`, `CartPole-v1`, `HalfCheetah-v4`: envpool's task of that id;
- `gymnax:<id>`: gymnax's environment of that id (`gymnax:Breakout-MinAtar`, `gymnax:Pendulum-v1`);
- `jax:<module>:<name>`: a researcher's own JAX environment with gymnax's interface, the class or
  factory `<name>` of the importable module `<module>` (`jax:my_package.envs:GridWorld`)."""

import re

GYMNAX_PREFIX = "gymnax:"
OWN_JAX_PREFIX = "jax:"

ENV_ID_SCHEME = (
    "an envpool id (Breakout-v5, CartPole-v1, HalfCheetah-v4), gymnax:<id> "
    "(gymnax:Breakout-MinAtar, gymnax:Pendulum-v1) or jax:<module>:<class or factory>"
)


def is_jax_env(env_id: str) -> bool:
    """A JAX environment (`cleanba_utils.jax_envs`), stepped inside the actor's compiled rollout."""
    return env_id.startswith((GYMNAX_PREFIX, OWN_JAX_PREFIX))


def name_part(env_id: str) -> str:
    """The id as a part of a folder's or a Hugging Face repository's name: every character other
    than letters, digits, `.`, `_` and `-` (a source's `:`, a path's `/`) becomes `-`
    (`gymnax:Breakout-MinAtar` -> `gymnax-Breakout-MinAtar`)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", env_id)
