"""The episodes of an actor's environments: their running returns and lengths, and each finished
episode logged (`charts/episodic_return`, `charts/episodic_length`)."""

import dataclasses
from collections import deque

import numpy as np
from tensorboardX import SummaryWriter


@dataclasses.dataclass
class Episodes:
    """The running return and length of each of an actor's environments; a finished episode is
    logged."""

    writer: SummaryWriter
    recent_returns: deque
    returns: np.ndarray
    lengths: np.ndarray

    def replayed_step(self, env_ids, reward, terminated, truncated):
        """A step that `env_records.fast_forward` replays: counted, not logged (its episode is
        logged when it ends; one that ended on the checkpoint's last step was logged before)."""
        self.returns[env_ids] += reward
        self.lengths[env_ids] += 1
        ended = env_ids[terminated | truncated]
        self.returns[ended] = 0.0
        self.lengths[ended] = 0

    def resume_running(self, state):
        """Takes the running returns and lengths of a JAX environment's recorded state
        (`jax_envs.EnvsState`, counted on the device): an episode that ended on the checkpoint's
        last step was logged before, and the next starts from 0."""
        ended = np.asarray(state.next_is_reset)
        self.returns[:] = np.where(ended, 0.0, state.episode_return)
        self.lengths[:] = np.where(ended, 0, state.episode_length)

    def step(self, reward, done, is_reset, global_step: int) -> list[float]:
        """`reward` unclipped; a reset step (envpool's step after an episode's end) belongs to no
        episode. Returns the returns of the episodes that finished."""
        playing = ~is_reset
        self.returns += reward * playing
        self.lengths += playing
        for i in np.flatnonzero(done):
            self.writer.add_scalar("charts/episodic_return", self.returns[i], global_step)
            self.writer.add_scalar("charts/episodic_length", self.lengths[i], global_step)
            self.recent_returns.append(self.returns[i])
        finished = self.returns[done].tolist()
        self.returns[done] = 0.0
        self.lengths[done] = 0
        return finished
