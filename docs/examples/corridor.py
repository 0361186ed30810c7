"""A researcher's own JAX environment, as every Cleanba script takes it: a class with gymnax's
interface (docs/jax_environments.md). The agent walks a corridor of `length` cells towards its far
end; reaching it gives reward 1 and ends the episode, which is cut at `max_steps_in_episode` steps.

    PYTHONPATH=docs/examples uv run python cleanba/cleanba_ppo.py --env-id jax:corridor:Corridor \\
        --hiddens 32 --local-num-envs 8 --num-actor-threads 1 --num-steps 32 \\
        --total-timesteps 50000 --env-params length=12
"""

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import environment, spaces


@struct.dataclass
class EnvState(environment.EnvState):
    position: jax.Array
    time: int


@struct.dataclass
class EnvParams(environment.EnvParams):
    length: int = 8
    max_steps_in_episode: int = 50


class Corridor(environment.Environment[EnvState, EnvParams]):
    """Actions: 0 steps back, 1 steps forward. Observation: the position, one-hot over the
    corridor's cells (at most 32)."""

    max_length = 32

    @property
    def default_params(self) -> EnvParams:
        return EnvParams()

    def step_env(self, key, state: EnvState, action, params: EnvParams):
        move = jnp.where(action == 1, 1, -1)
        position = jnp.clip(state.position + move, 0, params.length - 1)
        state = EnvState(position=position, time=state.time + 1)
        reached = position == params.length - 1
        reward = reached.astype(jnp.float32)
        return self.get_obs(state), state, reward, reached, {}

    def reset_env(self, key, params: EnvParams):
        # Start in the first half of the corridor, drawn from the key.
        position = jax.random.randint(key, (), 0, params.length // 2)
        state = EnvState(position=position, time=0)
        return self.get_obs(state), state

    def get_obs(self, state: EnvState, params=None, key=None):
        return jax.nn.one_hot(state.position, self.max_length)

    def is_terminated(self, state: EnvState, params: EnvParams):
        return state.position == params.length - 1

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params=None):
        return spaces.Box(0.0, 1.0, (self.max_length,), jnp.float32)
