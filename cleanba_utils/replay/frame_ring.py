"""Observations stored one frame each: a ring of frames per environment, from which a replay
rebuilds the stacked observations it samples (a stack of k frames stored once, not k times)."""

import dataclasses

import envpool
import numpy as np


def frame_spec(env_id: str):
    """(frames per observation, shape and dtype of one stored frame): stacked images store their
    newest frame."""
    space = envpool.make_spec(env_id).observation_space
    if len(space.shape) == 3:
        return space.shape[0], space.shape[1:], space.dtype
    return 1, space.shape, space.dtype


@dataclasses.dataclass
class FrameRing:
    """The newest frame of each step of every environment, in a ring of `ring` steps per
    environment, all advancing together: env g's step t is in frame slot g ring + t % ring, with its
    step in its episode (to 255)."""

    frames: np.ndarray
    episode_step: np.ndarray
    ring: int
    stack: int
    """frames per observation"""
    image: bool
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
        """The observations whose newest frames are in `frame_slots`, stacks rebuilt from single
        frames: a frame before the episode's first is its first, as envpool fills the stack at a
        reset."""
        ring = self.ring
        back = np.minimum(np.arange(self.stack)[::-1], self.episode_step[frame_slots][:, None])
        starts = (frame_slots - frame_slots % ring)[:, None]
        frames = self.frames[starts + (frame_slots[:, None] % ring - back) % ring]
        return frames if self.image else frames[:, 0]


def make_frame_ring(env_id: str, num_envs: int, ring: int) -> FrameRing:
    stack, frame_shape, dtype = frame_spec(env_id)
    return FrameRing(
        frames=np.zeros((num_envs * ring, *frame_shape), dtype),
        episode_step=np.zeros(num_envs * ring, np.uint8),
        ring=ring,
        stack=stack,
        image=len(frame_shape) == 2,
    )


def frame_ring_bytes(env_id: str, num_envs: int, ring: int) -> int:
    """A stored frame: its pixels and its step in its episode (uint8)."""
    _, frame_shape, dtype = frame_spec(env_id)
    return num_envs * ring * (int(np.prod(frame_shape)) * np.dtype(dtype).itemsize + 1)
