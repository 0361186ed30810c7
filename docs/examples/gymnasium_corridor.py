"""A researcher's own Gymnasium environment, as every Cleanba script takes it: a class with
Gymnasium's interface (docs/gymnasium_environments.md). The agent walks a corridor of `length`
cells towards its far end; reaching it gives reward 1 and ends the episode, which is cut at
`max_steps` steps. `Corridor` acts in discrete steps, `ContinuousCorridor` in a real.

    PYTHONPATH=docs/examples uv run python cleanba/cleanba_ppo.py \\
        --env-id gymnasium:gymnasium_corridor:Corridor --hiddens 32 --local-num-envs 8 \\
        --num-actor-threads 1 --num-steps 32 --total-timesteps 50000
    PYTHONPATH=docs/examples uv run python cleanba/cleanba_sac.py \\
        --env-id gymnasium:gymnasium_corridor:ContinuousCorridor --total-timesteps 20000
"""

from typing import ClassVar

import gymnasium
import numpy as np


class Corridor(gymnasium.Env):
    """Actions: 0 steps back, 1 steps forward. Observation: the position, one-hot over the
    corridor's cells."""

    metadata: ClassVar[dict] = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, length: int = 12, max_steps: int = 50, render_mode: str | None = None):
        self.length = length
        self.max_steps = max_steps
        self.render_mode = render_mode
        self.observation_space = gymnasium.spaces.Box(0.0, 1.0, (length,), np.float32)
        self.action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        # Seeds `self.np_random` (Cleanba resets environment g with seed + g once, then without a
        # seed): every draw comes from it, so the run depends on the seed alone.
        super().reset(seed=seed)
        self.position = int(self.np_random.integers(0, self.length // 2))
        self.steps = 0
        return self.observation(), {}

    def step(self, action):
        self.position = int(np.clip(self.position + (1 if action == 1 else -1), 0, self.length - 1))
        self.steps += 1
        reached = self.position == self.length - 1
        truncated = self.steps >= self.max_steps and not reached
        return self.observation(), float(reached), reached, truncated, {}

    def observation(self):
        return np.eye(self.length, dtype=np.float32)[self.position]

    def render(self):
        """The corridor as an RGB image (--capture-video films it): the walker's cell white, the
        end green, 16 pixels a cell."""
        cells = np.zeros((self.length, 3), np.uint8)
        cells[-1] = (0, 160, 0)
        cells[self.position] = (255, 255, 255)
        return np.repeat(np.repeat(cells[None], 16, axis=0), 16, axis=1)


class ContinuousCorridor(Corridor):
    """The same walk for the continuous-control scripts (SAC, continuous PPO, Ape-X DPG): the
    action is a real in [-1, 1], a step forward where it is positive and back otherwise."""

    def __init__(self, length: int = 12, max_steps: int = 50, render_mode: str | None = None):
        super().__init__(length, max_steps, render_mode)
        self.action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def step(self, action):
        return super().step(1 if action[0] > 0 else 0)
