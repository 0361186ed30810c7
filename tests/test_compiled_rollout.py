"""cleanba_utils.compiled_rollout: a rollout compiled as one program plays what a plain Python loop
over envpool's step plays with the same policy called once per step, keeps the same records and
episodes, and an actor thread resumed from its record continues as the uninterrupted one."""

import types
from collections import deque
from typing import NamedTuple

import envpool
import jax
import jax.numpy as jnp
import numpy as np

from cleanba_utils import compiled_rollout, env_records
from cleanba_utils.envs import flat_observation
from cleanba_utils.episodes import Episodes

ENV_ID = "Hopper-v4"  # episodes of about 20 steps under these actions: resets within a rollout
NUM_STEPS = 16
ENV_OFFSET = 2  # the thread's environments are the run's 2 and 3 (of 4)
NUM_ENVS = 4


class Doubled(NamedTuple):
    twice: jax.Array


def act(params, obs, env_ids, step, scale):
    """A deterministic policy of the observation, the step, the environment and a step input, in
    float32 as a script's (the rollout runs with 64-bit types on)."""
    shift = jnp.float32(0.01) * step.astype(jnp.float32)
    env_shift = jnp.float32(0.1) * jnp.asarray(env_ids, jnp.float32)[:, None]
    actions = jnp.tanh(obs[:, :3] * params + shift + env_shift) * scale
    return actions, Doubled(twice=2 * actions)


def make_env(args, seed: int, num_envs: int):
    return envpool.make(args.env_id, env_type="gymnasium", num_envs=num_envs, seed=seed)


class Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, key, value, step):
        self.scalars.append((key, float(value), step))


def episodes_of(writer: Writer, num_envs: int = 2) -> Episodes:
    """A run's episodes (`RunLogs.episodes`) logged to `writer`."""
    return Episodes(writer, deque(maxlen=100), np.zeros(num_envs), np.zeros(num_envs, np.int64))


ARGS = types.SimpleNamespace(
    env_id=ENV_ID, env_params=(), seed=3, local_num_envs=2, num_steps=NUM_STEPS
)
PARAMS = np.float32(0.7)


def scales(update: int) -> np.ndarray:
    return np.linspace(0.5, 1.0, NUM_STEPS, dtype=np.float32) * (1 + update % 2)


def started(writer: Writer, env_record=None):
    return compiled_rollout.start(
        make_env,
        ARGS,
        episodes=episodes_of(writer),
        num_envs=NUM_ENVS,
        env_offset=ENV_OFFSET,
        env_record=env_record,
        act=act,
    )


class HandRecord:
    """One environment's record kept by hand: its resets since it was made and the actions of its
    current episode (a reset step starts the next episode and takes no action)."""

    def __init__(self):
        self.resets = 0
        self.episode_actions = []

    def step(self, action, is_reset: bool):
        if is_reset:
            self.resets += 1
            self.episode_actions = []
        else:
            self.episode_actions.append(np.array(action))


class HandEpisodes:
    """The environments' running returns and lengths kept by hand, each finished episode logged as
    a run logs it: its return, then its length, at the step's global step."""

    def __init__(self, writer: Writer, num_envs: int):
        self.writer = writer
        self.returns = [0.0] * num_envs
        self.lengths = [0] * num_envs

    def step(self, rewards, dones, is_reset, global_step: int):
        for i in range(len(self.returns)):
            if not is_reset[i]:
                self.returns[i] += float(rewards[i])
                self.lengths[i] += 1
            if dones[i]:
                self.writer.add_scalar("charts/episodic_return", self.returns[i], global_step)
                self.writer.add_scalar("charts/episodic_length", self.lengths[i], global_step)
                self.returns[i] = 0.0
                self.lengths[i] = 0


def python_loop(played: list, writer: Writer):
    """The reference: envpool stepped from Python with the actions the compiled rollouts `played`
    chose (the environments' part must then match bit for bit on any machine), the records and
    episodes kept by hand (`HandRecord`, `HandEpisodes`: not the code under test). Per rollout:
    its steps' fields (steps, envs, ...), the observation after it and each environment's
    `HandRecord` then."""
    envs = make_env(ARGS, ARGS.seed + ENV_OFFSET, 2)
    obs = flat_observation(envs.reset()[0])
    next_is_reset = np.zeros(2, bool)
    records = [HandRecord(), HandRecord()]
    episodes = HandEpisodes(writer, 2)
    rollouts = []
    for update, rollout in enumerate(played, start=1):
        steps = []
        for step in range(NUM_STEPS):
            policy_step = (update - 1) * NUM_STEPS + step
            actions = rollout.steps.env_actions[:, step]
            next_obs, reward, terminated, truncated, _ = envs.step(actions.astype(np.float64))
            for record, action, is_reset in zip(records, actions, next_is_reset):
                record.step(action, bool(is_reset))
            done = terminated | truncated
            episodes.step(reward, done, next_is_reset, policy_step * NUM_ENVS)
            steps.append(
                dict(
                    obs=obs,
                    rewards=reward,
                    terminations=terminated,
                    truncations=truncated,
                    is_reset=next_is_reset,
                )
            )
            obs = flat_observation(next_obs)
            next_is_reset = done
        stacked = {key: np.stack([s[key] for s in steps]) for key in steps[0]}
        snapshot = [(r.resets, list(r.episode_actions)) for r in records]
        rollouts.append((stacked, obs, snapshot))
    return rollouts


def assert_record_is(record, expected: list):
    """`record` (an `env_records.EnvRecord`) holds each environment's resets and current episode as
    `expected` lists them."""
    for i, (resets, actions) in enumerate(expected):
        assert record.resets[i] == resets
        assert record.episode_lengths[i] == len(actions)
        if actions:
            np.testing.assert_array_equal(record.episode_actions[i, : len(actions)], actions)


def test_the_compiled_rollout_plays_what_a_python_loop_plays():
    writer = Writer()
    envs = started(writer)
    played = [envs.play(PARAMS, update, step_inputs=scales(update)) for update in range(1, 7)]
    reference_writer = Writer()
    reference = python_loop(played, reference_writer)
    # Episodes end in it, and some that began after a reset step end too.
    lengths = [value for key, value, _ in reference_writer.scalars if key.endswith("length")]
    assert len(lengths) > 2 * 2, lengths
    env_major = lambda x: np.swapaxes(x, 0, 1)
    policy = jax.jit(act)
    env_ids = np.arange(ENV_OFFSET, ENV_OFFSET + 2, dtype=np.int32)
    for update, (rollout, (stacked, next_obs, record)) in enumerate(zip(played, reference), 1):
        steps = rollout.steps
        assert steps.obs.shape == (2, NUM_STEPS, 11)
        for name in ("obs", "rewards", "terminations", "truncations", "is_reset"):
            np.testing.assert_array_equal(getattr(steps, name), env_major(stacked[name]), name)
        np.testing.assert_array_equal(rollout.next_obs, next_obs)
        assert_record_is(rollout.record, record)
        # The actions and outputs are the policy's, called once per step on the observations
        # acted on (within float rounding: the scan and a call per step are two XLA programs).
        for step in range(NUM_STEPS):
            with jax.enable_x64(True):
                actions, outputs = policy(
                    PARAMS,
                    steps.obs[:, step],
                    env_ids,
                    np.int32((update - 1) * NUM_STEPS + step),
                    scales(update)[step],
                )
            np.testing.assert_allclose(steps.env_actions[:, step], actions, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(steps.outputs.twice[:, step], outputs.twice, rtol=1e-6)
    # The same episodes, logged at the same global steps.
    assert writer.scalars == reference_writer.scalars and writer.scalars


def test_a_resumed_actor_continues_from_the_record_as_the_uninterrupted_one():
    uninterrupted = started(Writer())
    for update in range(1, 3):
        played = uninterrupted.play(PARAMS, update, step_inputs=scales(update))
    # The run's record: every environment's, this thread's at its global indices 2 and 3.
    run_record = env_records.empty_record(NUM_ENVS, ENV_ID)
    for field, part in zip(run_record, played.record):
        field[ENV_OFFSET:] = part
    resumed = started(Writer(), env_record=run_record)
    np.testing.assert_array_equal(resumed.next_obs, uninterrupted.next_obs)
    np.testing.assert_array_equal(resumed.next_is_reset, uninterrupted.next_is_reset)
    for update in range(3, 5):
        expected = uninterrupted.play(PARAMS, update, step_inputs=scales(update))
        got = resumed.play(PARAMS, update, step_inputs=scales(update))
        for name, field, other in zip(expected.steps._fields, got.steps, expected.steps):
            np.testing.assert_array_equal(
                jax.tree.leaves(field), jax.tree.leaves(other), err_msg=name
            )
