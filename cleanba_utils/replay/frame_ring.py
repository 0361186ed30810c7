"""Observations stored one frame each: a ring of frames per environment, from which a replay
rebuilds the stacked observations it samples (a stack of k frames stored once, not k times). Only
envpool's images are stacks of frames (Atari's, channels first); any other observation (a vector, a
JAX environment's image such as MinAtar's 10x10 channels of features, a Gymnasium environment's
image) is stored whole, as one frame."""

import dataclasses

import numpy as np

from cleanba_utils.env_ids import is_envpool_env
from cleanba_utils.envs import task_spaces


def stacks_frames(env_id: str) -> bool:
    """Whether the task's observations are stacked frames (frames, height, width): envpool's images
    (Atari's). A JAX or Gymnasium environment stacks none: the channels of a JAX environment's
    image are features
    (MinAtar's paddle, ball, trail, bricks), not steps of time."""
    return is_envpool_env(env_id) and len(task_spaces(env_id)[0].shape) == 3


def frame_spec(env_id: str):
    """(frames per observation, shape and dtype of one stored frame): stacked frames store their
    newest frame; any other observation is stored whole, one frame per observation."""
    space = task_spaces(env_id)[0]
    if stacks_frames(env_id):
        return space.shape[0], space.shape[1:], space.dtype
    return 1, space.shape, space.dtype


@dataclasses.dataclass
class FrameRing:
    """The stored frame (`frame_spec`) of each step of every environment, in a ring of `ring` steps
    per environment, all advancing together: env g's step t is in frame slot g ring + t % ring,
    with its step in its episode (to 255)."""

    frames: np.ndarray
    episode_step: np.ndarray
    ring: int
    stack: int
    """frames per observation"""
    stacked_frames: bool
    """the observations are stacks of frames (`stacks_frames`), rebuilt with their stack axis;
    otherwise each is its one stored frame"""
    steps: int = 0
    """the steps of every environment written so far"""

    def slots(self, env_ids, steps):
        """The frame slots of step `steps` (env-major) of the environments `env_ids`."""
        return env_ids[:, None].astype(np.int64) * self.ring + steps % self.ring

    def write(self, env_ids, frames, episode_step):
        """Writes the next steps of every environment (env-major (envs, steps, ...))."""
        slots = self.slots(env_ids, self.steps + np.arange(frames.shape[1]))
        self.frames[slots] = frames
        self.episode_step[slots] = episode_step
        self.steps += frames.shape[1]

    def stacked(self, frame_slots):
        """The observations whose stored frames are in `frame_slots`, stacks rebuilt from single
        frames: a frame before the episode's first is its first, as envpool fills the stack at a
        reset (an observation that is not a stack is its one frame)."""
        ring = self.ring
        back = np.minimum(np.arange(self.stack)[::-1], self.episode_step[frame_slots][:, None])
        starts = (frame_slots - frame_slots % ring)[:, None]
        frames = self.frames[starts + (frame_slots[:, None] % ring - back) % ring]
        return frames if self.stacked_frames else frames[:, 0]


def make_frame_ring(env_id: str, num_envs: int, ring: int) -> FrameRing:
    stack, frame_shape, dtype = frame_spec(env_id)
    return FrameRing(
        frames=np.zeros((num_envs * ring, *frame_shape), dtype),
        episode_step=np.zeros(num_envs * ring, np.uint8),
        ring=ring,
        stack=stack,
        stacked_frames=stacks_frames(env_id),
    )


def frame_ring_bytes(env_id: str, num_envs: int, ring: int) -> int:
    """A stored frame: its pixels and its step in its episode (uint8)."""
    _, frame_shape, dtype = frame_spec(env_id)
    return num_envs * ring * (int(np.prod(frame_shape)) * np.dtype(dtype).itemsize + 1)
