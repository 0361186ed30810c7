"""An actor thread's environments split into envpool instances stepped in turn
(`cleanba_utils.split_envs`): the same data as one instance, and each split stepping while the
others take their turn."""

import types
from collections import deque

import envpool
import numpy as np
import pytest

from cleanba_utils import split_envs
from cleanba_utils.split_envs import SplitEnvs


def make_breakout(seed, num_envs):
    return envpool.make(
        "Breakout-v5",
        env_type="gymnasium",
        num_envs=num_envs,
        seed=seed,
        num_threads=2,
        repeat_action_probability=0.25,
        max_episode_steps=60,
    )


def actions_of(step, env_ids):
    """A fixed action per (step, environment), as the scripts' per-environment sampling gives."""
    return ((step * 7 + env_ids * 3) % 4).astype(np.int32)


def play_one_instance(num_envs, num_steps):
    """A plain loop over one instance's synchronous `step`: the reference."""
    envs = make_breakout(10, num_envs)
    obs, _ = envs.reset()
    is_reset = np.zeros(num_envs, dtype=bool)
    rows = []
    for step in range(num_steps):
        actions = actions_of(step, np.arange(num_envs))
        next_obs, rewards, terminations, truncations, _ = envs.step(actions)
        rows.append((obs, actions, rewards, terminations, truncations, is_reset))
        is_reset = terminations | truncations
        obs = next_obs
    return rows, obs


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_the_splits_play_what_one_instance_plays(num_splits):
    """Two rollouts in a row (the second carries the first's environments on), against the plain
    loop: observations, actions, rewards, ends and reset steps equal, in environment order, with
    episodes ending inside the rollouts (60 steps at most)."""
    num_envs, num_steps = 7, 40
    expected, last_obs = play_one_instance(num_envs, 2 * num_steps)
    envs = SplitEnvs(make_breakout, seed=10, num_envs=num_envs, num_splits=num_splits)
    recorded = []

    def act(step, split, obs, is_reset):
        env_ids = np.arange(num_envs)[envs.env_slices[split]]
        return actions_of(step, env_ids), obs.copy()

    steps = []
    for first_step in (0, num_steps):
        played = envs.play(first_step, num_steps, act, lambda t, s: recorded.append(t))
        steps += played.steps
    assert recorded == list(range(2 * num_steps))
    assert any(row[5].any() for row in expected), "no episode ended: the test shows nothing"
    for step, (played, row) in enumerate(zip(steps, expected, strict=True)):
        obs, actions, rewards, terminations, truncations, is_reset = row
        np.testing.assert_array_equal(played.outputs, obs, err_msg=f"step {step}")
        np.testing.assert_array_equal(played.actions, actions)
        np.testing.assert_array_equal(played.rewards, rewards)
        np.testing.assert_array_equal(played.terminations, terminations)
        np.testing.assert_array_equal(played.truncations, truncations)
        np.testing.assert_array_equal(played.is_reset, is_reset)
        np.testing.assert_array_equal(played.info["env_id"], np.arange(num_envs))
    np.testing.assert_array_equal(envs.next_obs, last_obs)


class LoggingInstance:
    """Stands in for an envpool instance and logs the calls made on it."""

    def __init__(self, log, name, num_envs):
        self.log = log
        self.name = name
        self.num_envs = num_envs

    def reset(self):
        return np.zeros(self.num_envs), {}

    def send(self, actions):
        self.log.append(f"send {self.name}")

    def recv(self):
        self.log.append(f"recv {self.name}")
        zeros = np.zeros(self.num_envs)
        return zeros, zeros, zeros.astype(bool), zeros.astype(bool), {}


def test_each_split_steps_while_the_next_one_acts():
    """With two splits, a split's actions are sent before the other split's results are awaited
    and its actions chosen; a step's record comes once every split has been sent the next step."""
    log = []
    names = iter("ab")
    envs = SplitEnvs(
        lambda seed, n: LoggingInstance(log, next(names), n), seed=0, num_envs=4, num_splits=2
    )

    def act(step, split, obs, is_reset):
        log.append(f"act {'ab'[split]} {step}")
        return np.zeros(len(obs)), None

    envs.play(0, 2, act, lambda step, played: log.append(f"record {step}"))
    assert log == [
        *["act a 0", "send a", "act b 0", "send b"],
        *["recv a", "act a 1", "send a", "recv b", "act b 1", "send b", "record 0"],
        *["recv a", "recv b", "record 1"],
    ]


def test_an_actor_threads_environments_are_counted_among_the_runs():
    """`of_actor_thread`: the thread whose first environment is the run's 3rd plays environments
    3 .. 9, seeded as one instance of the run's seed would seed them, in --env-splits splits."""
    args = types.SimpleNamespace(seed=7, local_num_envs=7, env_splits=2)
    made = []

    def make_env(args, seed, num_envs):
        made.append((seed, num_envs))
        return make_breakout(seed, num_envs)

    envs = SplitEnvs.of_actor_thread(make_env, args, env_offset=3)
    np.testing.assert_array_equal(envs.env_ids, np.arange(3, 10))
    assert envs.env_ids.dtype == np.int32
    assert made == [(10, 4), (14, 3)]
    np.testing.assert_array_equal(envs.next_obs, make_breakout(10, 7).reset()[0])


class Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, key, value, step):
        self.scalars.append((key, float(value), step))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_start_splits_gives_the_compiled_rollouts_interface(num_splits):
    """`start_splits`: the policy's step in the compiled rollout's signature on the splits, the
    steps env-major as the plain loop plays them, the episodes counted and their ends listed, and
    `bootstrap` of the observation after the rollout."""
    import jax.numpy as jnp

    from cleanba_utils.episodes import Episodes

    num_envs, num_steps = 5, 40
    expected, last_obs = play_one_instance(num_envs, 2 * num_steps)
    args = types.SimpleNamespace(seed=10, local_num_envs=num_envs, env_splits=num_splits)
    args.num_steps = num_steps
    writer = Writer()
    episodes = Episodes(writer, deque(maxlen=100), np.zeros(num_envs), np.zeros(num_envs, np.int64))

    def act(params, obs, env_ids, step, step_input):
        return (step * 7 + env_ids * 3) % 4, jnp.float32(params) * env_ids

    rollout = split_envs.start_splits(
        lambda args, seed, n: make_breakout(seed, n),
        args,
        episodes=episodes,
        num_envs=num_envs,
        env_offset=0,
        env_record=None,
        act=act,
        bootstrap=lambda params, obs: obs.reshape(len(obs), -1).sum(axis=1),
    )
    plays = [rollout.play(np.float32(2), update) for update in (1, 2)]
    steps = [np.concatenate(fields, axis=1) for fields in zip(*[p.steps for p in plays])]
    obs, actions, outputs, rewards, terminations, truncations, is_reset = steps
    for step, row in enumerate(expected):
        for played, field in zip(
            (obs, actions, rewards, terminations, truncations, is_reset), row, strict=True
        ):
            np.testing.assert_array_equal(np.asarray(played)[:, step], field, err_msg=str(step))
    np.testing.assert_array_equal(
        outputs, np.broadcast_to(2 * np.arange(num_envs)[:, None], outputs.shape)
    )
    np.testing.assert_array_equal(plays[1].next_obs, last_obs)
    np.testing.assert_array_equal(
        plays[1].bootstrap_value, last_obs.reshape(num_envs, -1).sum(axis=1)
    )
    ends = [end for p in plays for end in p.episode_ends]
    ended = sum(int((row[3] | row[4]).sum()) for row in expected)
    assert ended and len(ends) == ended
    logged = [value for key, value, _ in writer.scalars if key == "charts/episodic_return"]
    assert logged == [end.episode_return for end in ends]
