"""gymnax's MinAtar Breakout with its 10x10x4 image flattened into a vector of 400 features, as
PureJaxRL's `FlattenObservationWrapper` gives it to its MLP: a researcher's own JAX environment
(`--env-id jax:minatar_flat:FlatBreakout` with `benchmark/` on PYTHONPATH), so that Cleanba PPO's
MLP takes the inputs PureJaxRL's takes (speed_purejaxrl_cpu.py)."""

from gymnax.environments import spaces
from gymnax.environments.minatar.breakout import MinBreakout


class FlatBreakout(MinBreakout):
    def get_obs(self, state, params=None, key=None):
        return super().get_obs(state, params, key).reshape(-1)

    def observation_space(self, params=None):
        return spaces.Box(0, 1, (400,))
