"""cleanba_apex_dqn.py: the sum tree, the replay and the targets against hand-written references,
then real short runs in subprocesses."""

import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PROMPT_EXIT_SECONDS,
    REPO,
    assert_refused,
    fingerprint_of,
    load_params,
    max_abs_difference,
    run_failing,
    run_script,
    scalar_tags,
    scalars,
    seconds_after_failure,
)
from scipy import stats

from cleanba import cleanba_apex_dqn as apex
from cleanba_utils.replay import frame_ring, sum_tree
from cleanba_utils.replay.n_step import n_step_transitions


def test_sum_tree_samples_in_proportion_to_priority_to_the_alpha():
    rng = np.random.default_rng(0)
    priorities = rng.uniform(0.05, 3.0, size=40)
    alpha = 0.6
    tree = sum_tree.empty(len(priorities))
    sum_tree.set_weights(tree, np.arange(len(priorities)), priorities**alpha)
    draws = np.concatenate([sum_tree.sample_stratified(tree, 512, rng) for _ in range(200)])
    counts = np.bincount(draws, minlength=len(priorities))
    assert len(draws) >= 100_000 and counts.sum() == len(draws)
    expected = len(draws) * priorities**alpha / (priorities**alpha).sum()
    assert stats.chisquare(counts, expected).pvalue > 1e-3
    # The test has the power to see the wrong law: sampling in proportion to the priority itself.
    wrong = len(draws) * priorities / priorities.sum()
    assert stats.chisquare(counts, wrong).pvalue < 1e-6


def test_sum_tree_priority_update_takes_effect_and_zero_is_never_drawn():
    rng = np.random.default_rng(1)
    tree = sum_tree.empty(10)
    sum_tree.set_weights(tree, np.arange(10), np.ones(10))
    assert sum_tree.total(tree) == 10
    sum_tree.set_weights(tree, [3, 7], [0.0, 91.0])
    assert sum_tree.total(tree) == 99
    draws = np.concatenate([sum_tree.sample_stratified(tree, 100, rng) for _ in range(50)])
    assert 3 not in draws
    assert 0.88 < np.mean(draws == 7) < 0.94
    # Targets exactly on the edges of intervals, around a zero weight, never land on it.
    assert 3 not in sum_tree.find(tree, [3.0, 3.0 - 1e-12, 2.9999999, 4.0 - 1e-15])
    np.testing.assert_array_equal(sum_tree.find(tree, [0.0, 0.5, 1.0, 98.999]), [0, 0, 1, 9])


def vector_args(**overrides):
    """CartPole's replay: one frame (the 4-vector) per observation."""
    return apex.Args(env_id="CartPole-v1", **overrides)


def insert_marked(replay, env_ids, start, length, n, priorities=None):
    """Inserts steps start .. start + length - 1 of every env, each transition's return marking its
    step."""
    num_envs = len(env_ids)
    steps = np.arange(start - n, start - n + length, dtype=np.float32)
    data = apex.Transitions(
        env_ids=np.asarray(env_ids),
        frames=np.zeros((num_envs, length, 4), np.float32),
        episode_step=np.zeros((num_envs, length), np.uint8),
        actions=np.zeros((num_envs, length), np.int32),
        returns=np.tile(steps, (num_envs, 1)),
        discounts=np.ones((num_envs, length), np.float32),
        offsets=np.full((num_envs, length), n, np.uint8),
        valid=np.tile(steps >= 0, (num_envs, 1)),
        priorities=np.ones((num_envs, length), np.float32) if priorities is None else priorities,
    )
    return apex.replay_insert(replay, data, n)


def test_fifo_eviction_keeps_the_newest_transitions():
    # 2 envs, rollouts of 7 steps, n = 3 and no stacking, a store of 40 transitions: every rollout
    # inserts steps S - 10 .. S - 4 of env 0, then of env 1 (the last 3 wait for their rewards);
    # the store keeps the last 40 inserted, and samples those from step 0 on.
    replay = apex.make_replay(vector_args(buffer_size=40, num_steps=7), num_envs=2)
    assert replay.frames.stack == 1 and replay.frames.ring == 20 + 2 * 7 + 3 + 1
    transitions = replay.transitions
    inserted = []
    for rollout in range(6):
        insert_marked(replay, [0, 1], 7 * rollout, 7, n=3)
        end = 7 * (rollout + 1)
        inserted += [(env, step) for env in range(2) for step in range(end - 10, end - 3)]
        sampleable = transitions.stored_weights() > 0
        env_of = transitions.items.obs[: transitions.size] // replay.frames.ring
        step_of = transitions.items.returns[: transitions.size].astype(int)
        kept = sorted(zip(env_of[sampleable].tolist(), step_of[sampleable].tolist()))
        assert kept == sorted((env, step) for env, step in inserted[-40:] if step >= 0), rollout
        _, sample = apex.replay_sample(replay, 256, np.random.default_rng(rollout), 0.4)
        assert (sample.items.returns >= 0).all() and sampleable[sample.slots].all()


def test_the_replay_at_a_mark_is_the_replay_that_stopped_there():
    # What a checkpoint of a JAX environment's run saves (`Replay.snapshot_at`), taken after two
    # more rollouts were inserted (a stop in the middle of an update): restored into an empty
    # replay, it samples the batches, frames included, of a replay that never saw them, evicting
    # transitions (a store of 40 filled by rollouts of 14) and going round the frame ring.
    args = vector_args(buffer_size=40, num_steps=7)

    def insert(replay, rollout):
        frames = np.zeros((2, 7, 4), np.float32)
        frames[..., 0] = 100 * np.arange(2)[:, None] + 7 * rollout + np.arange(7)
        priorities = np.full((2, 7), 1.0 + rollout, np.float32)
        insert_marked(replay, [0, 1], 7 * rollout, 7, n=3, priorities=priorities)
        replay.frames.frames.reshape(2, replay.frames.ring, 4)[
            :, (7 * rollout + np.arange(7)) % replay.frames.ring
        ] = frames

    went_on = apex.make_replay(args, num_envs=2)
    stopped = apex.make_replay(args, num_envs=2)
    for rollout in range(6):
        insert(went_on, rollout)
        insert(stopped, rollout)
    mark = went_on.mark()
    for rollout in range(6, 8):
        insert(went_on, rollout)
    assert went_on.frames.steps > went_on.frames.ring  # the ring went round since the mark
    restored = apex.make_replay(args, num_envs=2)
    restored.restore(went_on.snapshot_at(mark))
    for seed in range(3):
        expected, _ = apex.replay_sample(stopped, 64, np.random.default_rng(seed), 0.4)
        got, _ = apex.replay_sample(restored, 64, np.random.default_rng(seed), 0.4)
        for field in expected._fields:
            np.testing.assert_array_equal(getattr(got, field), getattr(expected, field), field)
    # The later rollouts changed what the replay samples: the comparison can fail.
    later, _ = apex.replay_sample(went_on, 64, np.random.default_rng(0), 0.4)
    assert not np.array_equal(later.obs, expected.obs)


def test_importance_weights_hand_computed():
    # Priorities 1 and 4 (one env each), alpha 0.5: sampling probabilities 1/3 and 2/3; weights
    # (1/P)^0.4 over the batch maximum (that of probability 1/3): 1 and (1/2)^0.4 = 0.757858.
    replay = apex.make_replay(vector_args(buffer_size=40, priority_exponent=0.5), num_envs=2)
    priorities = np.array([[1.0] * 7, [4.0] * 7], np.float32) - apex.PRIORITY_EPSILON
    insert_marked(replay, [0, 1], 0, 7, n=3, priorities=priorities)
    batch, sample = apex.replay_sample(replay, 64, np.random.default_rng(0), beta=0.4)
    first_env = sample.items.obs < replay.frames.ring
    np.testing.assert_allclose(batch.weights, np.where(first_env, 1.0, 0.5**0.4), rtol=1e-6)
    assert 0.25 < np.mean(first_env) < 0.42


def python_n_step(rewards, terminations, truncations, is_reset, gamma, n):
    """One environment's transitions, step by step: (valid, return, discount, offset)."""
    out = []
    for t in range(len(rewards) - n):
        if is_reset[t]:
            out.append((False, None, None, None))
            continue
        total, discount, offset = 0.0, gamma**n, n
        for k in range(n):
            total += gamma**k * rewards[t + k]
            if terminations[t + k] or truncations[t + k]:
                discount, offset = (0.0 if terminations[t + k] else gamma ** (k + 1)), k + 1
                break
        out.append((True, total, discount, offset))
    return out


def episode_stream(rng, num_steps, stack=4, max_length=9):
    """One environment as envpool plays it: random episode ends (termination or truncation), each
    followed by a reset step whose action is ignored and whose observation is the last of the ended
    episode. Returns per-step arrays and the true stacked observation and newest frame of every step
    (frames are unique numbers)."""
    steps = dict(rewards=[], terminations=[], truncations=[], is_reset=[], episode_step=[], obs=[])
    frame, history, in_episode, length, next_is_reset = 0, [], 0, rng.integers(1, max_length), False
    for _ in range(num_steps + 1):
        if not history:  # the first observation of an episode fills the stack
            history = [frame] * stack
        steps["obs"].append(history[-stack:])
        steps["episode_step"].append(in_episode)
        steps["is_reset"].append(next_is_reset)
        ended = not next_is_reset and in_episode + 1 >= length
        terminated = ended and rng.random() < 0.5
        steps["terminations"].append(terminated)
        steps["truncations"].append(ended and not terminated)
        steps["rewards"].append(0.0 if next_is_reset else float(rng.normal()))
        frame += 1
        if next_is_reset:
            history, in_episode, length = [], 0, rng.integers(1, max_length)
        else:
            history, in_episode = [*history, frame], in_episode + 1
        next_is_reset = ended
    return {key: np.array(value[:num_steps]) for key, value in steps.items()}, np.array(
        steps["obs"]
    )


def test_n_step_transitions_match_python_reference():
    rng = np.random.default_rng(0)
    streams = [episode_stream(rng, 80)[0] for _ in range(5)]
    window = {key: np.stack([s[key] for s in streams]) for key in streams[0]}
    keys = ["rewards", "terminations", "truncations", "is_reset"]
    returns, discounts, offsets, valid = n_step_transitions(
        *[window[k] for k in keys], gamma=0.9, n=3
    )
    assert window["terminations"].any() and window["truncations"].any() and window["is_reset"].any()
    for env, stream in enumerate(streams):
        for t, (ok, total, discount, offset) in enumerate(
            python_n_step(*[stream[k] for k in keys], 0.9, 3)
        ):
            assert valid[env, t] == ok
            if ok:
                np.testing.assert_allclose(returns[env, t], total, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(discounts[env, t], discount, rtol=1e-6)
                assert offsets[env, t] == offset


def test_n_step_hand_computed_episode_ends():
    # gamma 0.5, n 3. Step 1 terminates, step 2 is its reset step, step 4 is truncated, step 5 its
    # reset step. t0: 1 + 0.5 * 2 = 2, no bootstrap. t1: 2, no bootstrap. t3: 4 + 0.5 * 5 = 6.5,
    # bootstrap from the truncated episode's last observation (offset 2) with 0.25. t4: 5, with 0.5
    # from offset 1. t6: 7 + 3.5 + 2 = 12.5 with 0.125 from offset 3. t2 and t5 are reset steps: no
    # transition.
    rewards = np.array([[1.0, 2.0, 100.0, 4.0, 5.0, 100.0, 7.0, 7.0, 8.0, 0.0]], np.float32)
    terminations = np.array([[0, 1, 0, 0, 0, 0, 0, 0, 0, 0]], bool)
    truncations = np.array([[0, 0, 0, 0, 1, 0, 0, 0, 0, 0]], bool)
    is_reset = np.array([[0, 0, 1, 0, 0, 1, 0, 0, 0, 0]], bool)
    returns, discounts, offsets, valid = n_step_transitions(
        rewards, terminations, truncations, is_reset, gamma=0.5, n=3
    )
    np.testing.assert_array_equal(valid[0], [1, 1, 0, 1, 1, 0, 1])
    np.testing.assert_allclose(returns[0][valid[0]], [2.0, 2.0, 6.5, 5.0, 12.5])
    np.testing.assert_allclose(discounts[0][valid[0]], [0.0, 0.0, 0.25, 0.5, 0.125])
    np.testing.assert_array_equal(offsets[0][valid[0]], [2, 1, 2, 1, 3])


def test_replay_rebuilds_stacked_observations_and_bootstraps_across_rollouts_and_eviction():
    # Envpool-like streams go through the actor's processing (rollouts of 6 steps, the tail carried)
    # into a small Atari replay; every stored transition's observation and bootstrap observation
    # must be the true stacks.
    rng = np.random.default_rng(3)
    n, length, num_envs = 3, 6, 2
    truth = [episode_stream(rng, 60) for _ in range(num_envs)]
    args = apex.Args(env_id="Breakout-v5", buffer_size=2 * 17, num_steps=length)
    replay = apex.make_replay(args, num_envs)
    assert replay.frames.stack == 4 and replay.frames.ring == 17 + 2 * length + n + 4
    transitions = replay.transitions
    tail = apex.first_carry(num_envs, n).tail
    q_values = rng.normal(size=(num_envs, 60, 3)).astype(np.float32)
    for start in range(0, 60, length):
        cut = lambda key, start=start: np.stack(
            [stream[key][start : start + length] for stream, _ in truth]
        )
        frames = np.stack([obs[start : start + length, -1] for _, obs in truth])
        played = apex.Played(
            frames=np.broadcast_to(frames[..., None, None], (*frames.shape, 84, 84)).astype(
                np.uint8
            ),
            episode_step=cut("episode_step"),
            actions=np.zeros((num_envs, length), np.int32),
            q_taken=q_values[:, start : start + length, 1],
            q_max=q_values[:, start : start + length, 0],
            rewards=cut("rewards"),
            terminations=cut("terminations"),
            truncations=cut("truncations"),
            is_reset=cut("is_reset"),
        )
        data, tail = apex.rollout_data(played, tail, env_ids=np.arange(num_envs), gamma=0.9, n=n)
        apex.replay_insert(replay, data, n)
        end = start + length
        slots = np.flatnonzero(transitions.stored_weights() > 0)
        assert len(slots) > 0
        obs = replay.frames.stacked(transitions.items.obs[slots])
        next_obs = replay.frames.stacked(transitions.items.next_obs[slots])
        ring = replay.frames.ring
        for slot, o, next_o in zip(slots, obs, next_obs):
            env, position = divmod(int(transitions.items.obs[slot]), ring)
            t = end - n - 1 - (end - n - 1 - position) % ring  # the step of this frame slot
            # The store keeps the last 34 transitions inserted, 12 a rollout.
            assert max(0, end - n - 3 * length) <= t < end - n
            stream, true_obs = truth[env]
            reference = python_n_step(
                *[stream[k] for k in ["rewards", "terminations", "truncations", "is_reset"]], 0.9, n
            )
            ok, total, discount, offset = reference[t]
            assert ok
            np.testing.assert_array_equal(o[:, 0, 0], true_obs[t] % 256)
            np.testing.assert_array_equal(next_o[:, 0, 0], true_obs[t + offset] % 256)
            np.testing.assert_allclose(transitions.items.returns[slot], total, rtol=1e-5, atol=1e-6)
            # Initial priority: |R + discount max Q(bootstrap) - Q(s, a)| under the actor's
            # Q-values.
            priority = abs(total + discount * q_values[env, t + offset, 0] - q_values[env, t, 1])
            weight = transitions.stored_weights()[slot]
            np.testing.assert_allclose(weight, (priority + apex.PRIORITY_EPSILON) ** 0.6, rtol=1e-4)


def test_minatar_images_are_stored_whole_and_come_back_unchanged():
    # MinAtar's (C, 10, 10) float channels are features, not stacked frames: one frame per
    # observation, the whole observation, float32; every sampled observation and bootstrap
    # observation is exactly the one inserted.
    args = apex.Args(env_id="gymnax:Breakout-MinAtar", buffer_size=64, num_steps=5)
    stack, frame_shape, dtype = frame_ring.frame_spec(args.env_id)
    assert (stack, dtype) == (1, np.float32) and len(frame_shape) == 3
    assert frame_shape[1:] == (10, 10)
    assert not frame_ring.stacks_frames(args.env_id) and frame_ring.stacks_frames("Breakout-v5")
    n, num_envs = 3, 2
    replay = apex.make_replay(args, num_envs)
    rng = np.random.default_rng(4)
    truth = rng.random((num_envs, 30, *frame_shape), dtype=np.float32)  # not 0 or 1, not /255
    tail = apex.first_carry(num_envs, n).tail
    for start in range(0, 30, args.num_steps):
        cut = slice(start, start + args.num_steps)
        zeros = np.zeros((num_envs, args.num_steps), np.float32)
        played = apex.Played(
            frames=truth[:, cut],
            episode_step=np.zeros((num_envs, args.num_steps), np.uint8),
            actions=zeros.astype(np.int32),
            q_taken=zeros,
            q_max=zeros,
            # Each transition's return is the step it starts at (gamma 0: its first reward).
            rewards=np.tile(np.arange(30, dtype=np.float32)[cut], (num_envs, 1)),
            terminations=zeros.astype(bool),
            truncations=zeros.astype(bool),
            is_reset=zeros.astype(bool),
        )
        data, tail = apex.rollout_data(played, tail, env_ids=np.arange(num_envs), gamma=0.0, n=n)
        apex.replay_insert(replay, data, n)
    batch, sample = apex.replay_sample(replay, 64, rng, beta=0.4)
    assert batch.obs.shape == (64, *frame_shape) and batch.obs.dtype == np.float32
    env = sample.items.obs // replay.frames.ring
    step = batch.returns.astype(int)
    np.testing.assert_array_equal(batch.obs, truth[env, step])
    np.testing.assert_array_equal(batch.next_obs, truth[env, step + n])


def test_minatar_network_takes_float_images_as_they_are():
    # The default network of small images is Young & Tian's: one 3x3 convolution of 16 channels,
    # then 128 hidden units (here in each dueling stream); Atari's defaults stay the Nature DQN's.
    args = apex.parse_args(["--env-id", "gymnax:Breakout-MinAtar"])
    assert (args.torso, args.channels, args.hiddens) == ("minatar", None, (128,))
    atari = apex.parse_args(["--env-id", "Breakout-v5"])
    assert (atari.torso, atari.hiddens) == ("nature", (512,))
    state = apex.init_state(args, apex.sizes_of(args, 1), replay=None)[1].learner
    shapes = jax.tree.map(lambda x: x.shape, state.params["params"])
    channels = shapes["MinAtarTorso_0"]["Conv_0"]["kernel"][2]
    assert shapes["MinAtarTorso_0"]["Conv_0"]["kernel"] == (3, 3, channels, 16)
    assert sorted(shapes[f"Dense_{i}"]["kernel"] for i in range(4))[-2:] == [(1024, 128)] * 2
    # A uint8 image is scaled by 1/255 and a float one is not: the same pixels as uint8 and as
    # their float quotient give the same Q-values (up to XLA's rounding of the division).
    network = apex.network_of(args, num_actions=3)
    pixels = np.random.default_rng(0).integers(0, 256, (2, channels, 10, 10)).astype(np.uint8)
    q = lambda obs: np.asarray(network.apply(state.params, jnp.asarray(obs)))
    scaled = pixels.astype(np.float32) / np.float32(255)
    np.testing.assert_allclose(q(pixels), q(scaled), rtol=1e-5, atol=1e-6)
    assert not np.allclose(q(pixels), q(pixels.astype(np.float32)), rtol=1e-2)


def test_double_q_targets_match_python_reference():
    rng = np.random.default_rng(0)
    batch_size, num_actions = 6, 3
    q_values, q_next_online, q_next_target = (
        rng.normal(size=(batch_size, num_actions)) for _ in range(3)
    )
    batch = apex.Batch(
        obs=jnp.zeros((batch_size, 1)),
        actions=jnp.asarray(rng.integers(0, num_actions, batch_size)),
        returns=jnp.asarray(rng.normal(size=batch_size), jnp.float32),
        discounts=jnp.asarray([0.0, 0.9**3, 0.9, 0.9**2, 0.0, 0.9**3], jnp.float32),
        next_obs=jnp.zeros((batch_size, 1)),
        weights=jnp.asarray(rng.uniform(0.2, 1.0, batch_size), jnp.float32),
    )
    apply_fn = lambda params, obs: jnp.asarray(q_values, jnp.float32)
    loss, (td, _) = apex.dqn_loss(
        None,
        apply_fn=apply_fn,
        batch=batch,
        q_next_target=jnp.asarray(q_next_target, jnp.float32),
        q_next_online=jnp.asarray(q_next_online, jnp.float32),
        batch_size=12,
    )
    expected_td, expected_loss = [], 0.0
    for i in range(batch_size):
        best = int(
            np.argmax(q_next_online[i])
        )  # selected by the online network, evaluated by the target
        target = float(batch.returns[i]) + float(batch.discounts[i]) * q_next_target[i][best]
        expected_td.append(target - q_values[i][int(batch.actions[i])])
        expected_loss += float(batch.weights[i]) * 0.5 * expected_td[-1] ** 2 / 12
    np.testing.assert_allclose(td, expected_td, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


def test_epsilon_schedule_and_epsilon_greedy():
    epsilons = apex.epsilons_of(np.arange(8), 8, 0.4, 7.0)
    np.testing.assert_allclose(epsilons[[0, 7]], [0.4, 0.4**8])
    np.testing.assert_allclose(epsilons[3], 0.4**4)  # 1 + 7 * 3 / 7
    np.testing.assert_allclose(apex.epsilons_of([0], 1, 0.4, 7.0), [0.4])
    q_values = jnp.tile(jnp.array([0.0, 1.0, 0.0, 0.0]), (6, 1))
    key = jax.random.PRNGKey(0)
    ids = jnp.arange(6)
    greedy = jax.jit(apex.epsilon_greedy)
    act = lambda q, eps, step, env_ids: greedy(q, epsilons=eps, key=key, step=step, env_ids=env_ids)
    np.testing.assert_array_equal(act(q_values, jnp.zeros(6), 3, ids), np.ones(6))
    random = np.concatenate([act(q_values, jnp.ones(6), step, ids) for step in range(20)])
    assert set(random.tolist()) == {0, 1, 2, 3}
    # Keyed by (step, global env index): the same actions whatever the split of the environments.
    eps = jnp.full(6, 0.5)
    halves = [act(q_values[:3], eps[:3], 7, ids[:3] + k) for k in (0, 3)]
    np.testing.assert_array_equal(act(q_values, eps, 7, ids), np.concatenate(halves))


LAYOUT_ATOL = 1e-5

CARTPOLE_TINY = [
    "--env-id",
    "CartPole-v1",
    "--hiddens",
    16,
    16,
    "--local-num-envs",
    4,
    "--num-steps",
    8,
    "--total-timesteps",
    2048,
    "--learning-starts",
    256,
    "--batch-size",
    32,
    "--updates-per-rollout",
    2,
    "--buffer-size",
    4096,
    "--target-update-period",
    10,
    "--log-frequency",
    1000,
    "--run-name",
    "tiny",
]


def test_same_seed_same_fingerprint_with_or_without_pipeline_and_evaluation(tmp_path):
    # The replay's work runs in one fixed order whether or not it overlaps the update, and the
    # evaluation has environments and seeds of its own: neither changes the run.
    variants = {
        "0": [],
        "1": [],
        "serial_eval": ["--no-pipeline", "--eval-episodes", 2, "--eval-every", 5],
    }
    results = {}
    for name, extra in variants.items():
        (tmp_path / name).mkdir()
        results[name] = run_script("cleanba_apex_dqn.py", [*CARTPOLE_TINY, *extra], tmp_path / name)
        assert results[name].returncode == 0, results[name].stderr[-3000:]
    assert len({fingerprint_of(result) for result in results.values()}) == 1
    # 8 envs x 8 steps per iteration, 32 iterations; the replay holds 40 + 64 k transitions after
    # iteration k + 1, so learning starts (>= 256) at iteration 5 and makes 2 updates in each of the
    # last 28.
    updates = scalars(tmp_path / "0" / "runs" / "tiny", "stats/optimizer_steps")
    assert updates[-1][1] == 2 * 28
    run_dir = tmp_path / "serial_eval" / "runs" / "tiny"
    evaluations = scalars(run_dir, "charts/eval_return")
    # The untrained policy's at step 0, before any optimizer step, then every 5 updates.
    assert [step for step, _ in evaluations] == [320 * k for k in range(7)] + [2048]
    assert scalars(run_dir, "charts/opt_step")[0] == (0, 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_return"] == pytest.approx(evaluations[-1][1])
    assert [step for step, _ in summary["eval_returns"]] == [step for step, _ in evaluations]
    # Environments 6 and 7 of 8, the quarter with the lowest ε, log their returns under their own
    # key.
    assert "charts/lowest_epsilon_return" in scalar_tags(run_dir)
    lowest_epsilon = scalars(run_dir, "charts/lowest_epsilon_return")
    assert 0 < len(lowest_epsilon) < len(scalars(run_dir, "charts/episodic_return")) / 3


MINATAR_TINY = [
    *["--env-id", "gymnax:Breakout-MinAtar", "--channels", 4, "--hiddens", 16],
    *["--local-num-envs", 2, "--num-actor-threads", 1, "--num-steps", 8],
    *["--total-timesteps", 256, "--learning-starts", 64, "--batch-size", 16],
    *["--updates-per-rollout", 2, "--buffer-size", 512, "--target-update-period", 10],
    *["--log-frequency", 1000],
]


# In the long checks (`-m long`): its runs cost the README's test command about 20 s.
@pytest.mark.long
def test_minatar_in_the_compiled_rollout_repeats_its_fingerprint(tmp_path):
    # A JAX environment's actor plays in one compiled program and its replay stores whole float
    # images; the same seed gives the same run.
    fingerprints = []
    for name in "ab":
        (tmp_path / name).mkdir()
        result = run_script("cleanba_apex_dqn.py", [*MINATAR_TINY, "--run-name", name], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        fingerprints.append(fingerprint_of(result))
    assert fingerprints[0] == fingerprints[1]
    # 2 envs x 8 steps per update: learning starts once the replay holds 64 transitions.
    updates = scalars(tmp_path / "runs" / "a", "stats/optimizer_steps")
    assert 0 < updates[-1][1] < 2 * 16


def test_one_and_two_learner_devices_agree(tmp_path):
    args = [*CARTPOLE_TINY, "--save-model"]
    models = []
    for name, devices in [("one", ["0"]), ("two", ["0", "1"])]:
        (tmp_path / name).mkdir()
        result = run_script(
            "cleanba_apex_dqn.py",
            [*args, "--learner-device-ids", *devices],
            tmp_path / name,
            devices=2,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        models.append(
            load_params(tmp_path / name / "runs" / "tiny" / "cleanba_apex_dqn.cleanba_model")
        )
    # The same batches and the same summed gradients, summed in another order.
    assert max_abs_difference(*models) < LAYOUT_ATOL


def test_resume_restores_parameters_target_and_counters_and_refills_the_replay(tmp_path):
    args = [*CARTPOLE_TINY, "--checkpoint-every", 8]
    assert run_script("cleanba_apex_dqn.py", args, tmp_path).returncode == 0
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    (checkpoints / "update_000000032.ckpt").unlink()
    result = run_script("cleanba_apex_dqn.py", [*args, "--resume"], tmp_path)
    assert result.returncode == 0 and "resuming tiny from update 24" in result.stdout, (
        result.stderr[-3000:]
    )
    # 2 x (24 - 4) = 40 updates before the checkpoint; the replay restarts empty and holds 40 + 64 k
    # transitions after k + 1 iterations, so updates resume at iteration 29: 40 + 2 x 4.
    updates = dict(scalars(tmp_path / "runs" / "tiny", "stats/optimizer_steps"))
    assert updates[24 * 64] == 40 and updates[28 * 64] == 40 and updates[32 * 64] == 48


def test_short_atari_run_logs_the_diagnostics(tmp_path):
    args = ["--env-id", "Breakout-v5", "--torso", "impala", "--channels", 4, "--hiddens", 16]
    args += ["--local-num-envs", 4]
    args += [
        "--num-actor-threads",
        2,
        "--num-steps",
        8,
        "--total-timesteps",
        384,
        "--learning-starts",
        100,
    ]
    args += [
        "--batch-size",
        16,
        "--updates-per-rollout",
        2,
        "--buffer-size",
        1024,
        "--log-frequency",
        2,
    ]
    result = run_script(
        "cleanba_apex_dqn.py", [*args, "--run-name", "atari", "--save-model"], tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "atari"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 384 and summary["params_fingerprint"] == fingerprint_of(result)
    expected = {
        "charts/SPS",
        "stats/actor_sps",
        "stats/optimizer_steps_per_second",
        "stats/replay_size",
    }
    expected |= {"stats/priority_mean", "stats/insert_time", "stats/replay_time"}
    expected |= {
        "stats/priority_max",
        "stats/is_weight_min",
        "stats/is_weight_max",
        "stats/epsilon_min",
    }
    expected |= {"stats/epsilon_max", "stats/param_lag", "losses/td_loss"}
    assert expected <= scalar_tags(run_dir)
    # 8 envs x 8 steps per iteration; the first rollout leaves its last 3 steps for the next;
    # learning starts at the second iteration (2 x 64 - 8 x 3 = 104 >= 100 transitions): 5
    # iterations x 2 updates.
    assert [v for _, v in scalars(run_dir, "stats/replay_size")] == [40, 104, 168, 232, 296, 360]
    assert scalars(run_dir, "stats/optimizer_steps")[-1][1] == 10
    assert [v for _, v in scalars(run_dir, "stats/param_lag")] == [0, 1, 1, 1, 1, 1]
    np.testing.assert_allclose(scalars(run_dir, "stats/epsilon_max")[0][1], 0.4, rtol=1e-6)
    np.testing.assert_allclose(scalars(run_dir, "stats/epsilon_min")[0][1], 0.4**8, rtol=1e-5)
    assert all(0 < v <= 1 for _, v in scalars(run_dir, "stats/is_weight_min"))
    assert (run_dir / "cleanba_apex_dqn.cleanba_model").exists()


def test_a_crashing_actor_ends_the_process(tmp_path):
    result = run_failing(
        "cleanba_apex_dqn", "actor", [*CARTPOLE_TINY[:-8], "--total-timesteps", 1_000_000], tmp_path
    )
    assert result.returncode == 1 and "environment exploded" in result.stderr
    assert seconds_after_failure(result, time.time()) < PROMPT_EXIT_SECONDS


def test_a_crashing_replay_thread_ends_the_process(tmp_path):
    program = (
        "import sys\nimport time\nimport cleanba.cleanba_apex_dqn as script\n"
        "def exploding_sample(*args):\n"
        "    print(f'failed at {time.time()}', file=sys.stderr, flush=True)\n"
        "    raise RuntimeError('sampler exploded')\n"
        "script.sample_batch = exploding_sample\nscript.main(sys.argv[1:])\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            program,
            *map(str, CARTPOLE_TINY[:-8]),
            "--total-timesteps",
            "1000000",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "sampler exploded" in result.stderr, result.stderr[-3000:]
    assert seconds_after_failure(result, time.time()) < PROMPT_EXIT_SECONDS


def readme_commands() -> list[list[str]]:
    """The commands of docs/apex_dqn.md, each a list of arguments of the script."""
    readme = (REPO / "docs" / "apex_dqn.md").read_text()
    section = readme[readme.index("## Running it") :]
    block = section[section.index("```bash") + len("```bash") : section.index("```\n", 10)]
    lines = block.replace("\\\n", " ").splitlines()
    commands = [line.split() for line in lines if "cleanba_apex_dqn.py" in line]
    return [command[command.index("cleanba/cleanba_apex_dqn.py") + 1 :] for command in commands]


@pytest.mark.long
def test_readme_commands_run_with_their_defaults_for_fewer_steps(tmp_path):
    commands = readme_commands()
    assert len(commands) == 2 and ["--env-id", "Breakout-v5"] in commands
    for index, command in enumerate(commands):
        # Two updates; on Breakout, one with 6 optimizer steps of batch 512 on the default network
        # (the replay shrunk from 2M, which needs 16 GiB free).
        shorter = ["--total-timesteps", 8192, "--learning-starts", 4096, "--buffer-size", 16384]
        result = run_script(
            "cleanba_apex_dqn.py", [*command, *shorter, "--run-name", index], tmp_path, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads((tmp_path / "runs" / str(index) / "summary.json").read_text())


# Through a real process: exit code 2, one line, no traceback, nothing written.
PROCESS_BAD_INPUTS = [
    (["--buffer-size", 10**9], "--buffer-size"),
    (["--env-id", "NoSuchGame-v5"], "--env-id"),
    (["--n-step", "x"], "--n-step"),
]
BAD_INPUTS = [
    (["--total-timesteps", "0"], "--total-timesteps"),
    (["--learning-rate", "-1"], "--learning-rate"),
    (["--gamma", "1.5"], "--gamma"),
    (["--n-step", "0"], "--n-step"),
    (["--batch-size", "0"], "--batch-size"),
    (["--updates-per-rollout", "0"], "--updates-per-rollout"),
    (["--target-update-period", "0"], "--target-update-period"),
    (["--priority-exponent", "nan"], "--priority-exponent"),
    (["--importance-sampling-exponent", "1.5"], "--importance-sampling-exponent"),
    (["--epsilon-base", "2"], "--epsilon-base"),
    (["--learning-starts", "100", "--buffer-size", "50"], "--learning-starts"),
    (["--buffer-size", "1000", "--learning-starts", "0"], "--buffer-size"),
    (["--buffer-size", str(10**10)], "--buffer-size"),
    (["--learner-device-ids", "7"], "--learner-device-ids"),
    (["--resume"], "--resume"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--eval-episodes", "-2"], "--eval-episodes"),
    (["--torso", "vgg"], "--torso"),
    (["--buffer-size", "4000"], "--buffer-size"),
    (["--env-id", "gymnax:Breakout-MinAtar", "--torso", "nature"], "--torso"),
]


@pytest.mark.parametrize("args,option", PROCESS_BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, option):
    result = run_script("cleanba_apex_dqn.py", args, tmp_path, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args,option", BAD_INPUTS)
def test_bad_input_is_refused_with_one_line(capsys, args, option):
    assert_refused(apex, args, option, capsys)


def test_default_network_and_optimizer_are_the_papers():
    args = apex.Args(env_id="Breakout-v5")
    state = apex.init_state(args, apex.sizes_of(args, 1), replay=None)[1].learner
    shapes = jax.tree.map(lambda x: x.shape, state.params["params"])
    torso = shapes["NatureTorso_0"]
    assert [torso[f"Conv_{i}"]["kernel"] for i in range(3)] == [
        (8, 8, 4, 32),
        (4, 4, 32, 64),
        (3, 3, 64, 64),
    ]
    # The value and the advantage streams (each output layer is named before its hidden layer): 7 x
    # 7 x 64 features, 512 hidden units each.
    assert [shapes[f"Dense_{i}"]["kernel"] for i in range(4)] == [
        (512, 1),
        (3136, 512),
        (512, 18),
        (3136, 512),
    ]
    # TensorFlow's RMSProp starts its second-moment estimate at 1, centered: the first moment at 0.
    is_moments = lambda s: hasattr(s, "nu")
    moments = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_moments) if is_moments(s)]
    assert len(moments) == 1
    assert all((np.asarray(nu) == 1).all() for nu in jax.tree.leaves(moments[0].nu))
    assert all((np.asarray(mu) == 0).all() for mu in jax.tree.leaves(moments[0].mu))


def test_anneal_lr_decays_linearly_over_the_runs_optimizer_steps():
    # 4 envs x 8 steps = 32 steps per update: 3,200 steps are 100 updates of 4 optimizer steps.
    args = apex.Args(
        env_id="CartPole-v1",
        local_num_envs=4,
        num_actor_threads=1,
        num_steps=8,
        total_timesteps=3200,
        updates_per_rollout=4,
        learning_rate=1e-3,
    )
    assert apex.learning_rate_of(args, apex.sizes_of(args, 1)) == 1e-3
    args.anneal_lr = True
    schedule = apex.learning_rate_of(args, apex.sizes_of(args, 1))
    for step, expected in [(0, 1e-3), (100, 7.5e-4), (200, 5e-4), (400, 0.0), (500, 0.0)]:
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-9)
