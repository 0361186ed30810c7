"""The recurrent core of a network (`--core lstm` or `--core gru`; PPO, IMPALA, continuous PPO):
flax's LSTM or GRU cell between the torso and the heads, its state carried per environment across
steps and rollouts and reset to zeros where an episode starts.

One rule, for the actor's steps and the learner's sequences alike: the state leaving step t is
reset where step t is a reset step (`is_reset`: envpool's step after an episode's end, which
ignores the action and returns the next episode's first observation; a JAX or Gymnasium
environment's as their rollouts map them). The next episode's first observation thus meets a zero
state, and the reset step's own output (masked out of learning) never reaches another episode.

A network with a core takes sequences, time-major: observations (T, N, ...), the state entering
step 0 and `is_reset` (T, N). The actor calls it with T = 1 at every step; the learner replays an
environment's whole rollout from the state its first step met (`rollout_steps.PlayedRollout`), so
the learner's outputs are the actor's up to float rounding."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from cleanba_utils.fields import Need


def initial_state(kind: str, size: int, num_envs: int) -> Any:
    """The state of `num_envs` environments before their first step: zeros (flax's cells' own
    initial carry), the LSTM's (c, h), the GRU's h."""
    zeros = jnp.zeros((num_envs, size), jnp.float32)
    return (zeros, zeros) if kind == "lstm" else zeros


def reset_where(is_reset, state):
    """`state` with the environments of `is_reset` (N,) back at zeros."""
    return jax.tree.map(lambda s: jnp.where(is_reset[:, None], jnp.zeros_like(s), s), state)


class CoreStep(nn.Module):
    """One step of the cell on every environment, the state reset after a reset step."""

    kind: str
    size: int

    @nn.compact
    def __call__(self, state, inputs):
        x, is_reset = inputs
        cell = nn.OptimizedLSTMCell(self.size) if self.kind == "lstm" else nn.GRUCell(self.size)
        state, y = cell(state, x)
        return reset_where(is_reset, state), y


class Core(nn.Module):
    """The cell over a sequence: `(state, x (T, N, F), is_reset (T, N)) -> (state after step T - 1,
    outputs (T, N, size))`, one set of parameters for every step."""

    kind: str
    size: int

    @nn.compact
    def __call__(self, state, x, is_reset):
        scanned = nn.scan(
            CoreStep,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=0,
            out_axes=0,
        )
        return scanned(self.kind, self.size, name="cell")(state, (x, is_reset))


def has_core(args) -> bool:
    return args.core != "none"


A_CORE = Need(has_core, "a recurrent core (--core lstm or --core gru)")
"""What --core-size needs."""


def init_network(network: nn.Module, key, obs):
    """`network`'s parameters from one batch of observations (N, ...): with a core, as a sequence
    of one step from the zero state."""
    if network.core == "none":
        return network.init(key, obs)
    num_envs = obs.shape[0]
    first_state = initial_state(network.core, network.core_size, num_envs)
    return network.init(key, obs[None], first_state, jnp.zeros((1, num_envs), bool))
