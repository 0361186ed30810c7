"""MinAtar's Breakout as the `minatar` package (1.0.15) makes it for Gymnasium, for
`benchmark/gymnasium_cpu.py`: `--env-id gymnasium:gymnasium_minatar:breakout` with this folder on
PYTHONPATH. What the package registers as `MinAtar/Breakout-v1` (sticky actions of 0.1, no cap on
an episode's length, the minimal action set of 3 actions), with one change: its reset seeds
Gymnasium's `np_random` too, as Gymnasium's environment checker, which a factory's environment
meets at the start of a run, asks (the game draws from its own generator, which the seed seeds
either way)."""

import gymnasium
from minatar.gym import BaseEnv


class SeededMinAtar(BaseEnv):
    def reset(self, *, seed=None, options=None):
        gymnasium.Env.reset(self, seed=seed)
        return super().reset(seed=seed, options=options)


def breakout():
    return SeededMinAtar(game="breakout", use_minimal_action_set=True)
