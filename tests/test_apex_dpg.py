"""cleanba_apex_dpg.py: the losses, the clip, the transitions, the noise and the replay's use
against hand-written references, then short Hopper runs in two subprocesses (2 CPU devices) for
determinism, layout invariance, evaluation, resume, failures and bad inputs."""

import json
import os
import subprocess
import sys
import time

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PROMPT_EXIT_SECONDS,
    REPO,
    assert_refused,
    load_params,
    max_abs_difference,
    run_failing,
    run_script,
    scalar_tags,
    scalars,
    seconds_after_failure,
)
from preempt import assert_resumed_as_uninterrupted
from scipy import stats

from cleanba import cleanba_apex_dpg as dpg
from cleanba_utils import checkpoints
from cleanba_utils.devices import replicate
from cleanba_utils.replay.prioritized_learning import PendingPriorities, write_priorities
from cleanba_utils.rollout_steps import Steps

SPACES = dpg.Spaces(obs_dim=3, action_low=(-1.0, -2.0), action_high=(1.0, 0.0))


def numpy_layers(params) -> list:
    return [params["params"][f"Dense_{i}"] for i in range(len(params["params"]))]


def dense(layer, x):
    return x @ np.asarray(layer["kernel"]) + np.asarray(layer["bias"])


def numpy_relu(x):
    return np.maximum(x, 0.0)


def numpy_critic(params, obs, action, first_activation=np.tanh):
    """tanh (or relu) of the first layer of the observation, the action appended, relu layers, a
    linear output."""
    layers = numpy_layers(params)
    x = np.concatenate([first_activation(dense(layers[0], obs)), action], axis=1)
    for layer in layers[1:-1]:
        x = np.maximum(dense(layer, x), 0.0)
    return dense(layers[-1], x)[:, 0]


def numpy_actor(params, obs, low, high, first_activation=np.tanh):
    """tanh (or relu) of the first layer, relu layers, a tanh output scaled from [-1, 1] to [low,
    high]."""
    layers = numpy_layers(params)
    x = first_activation(dense(layers[0], obs))
    for layer in layers[1:-1]:
        x = np.maximum(dense(layer, x), 0.0)
    return low + (high - low) * (np.tanh(dense(layers[-1], x)) + 1) / 2


def random_params(module, key, *inputs):
    """Parameters far from the small initialization of the output layers, so that every term
    counts."""
    params = module.init(key, *inputs)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(key, 7), len(leaves))
    return jax.tree.unflatten(
        tree, [0.5 * jax.random.normal(k, leaf.shape) for k, leaf in zip(keys, leaves)]
    )


def test_losses_and_n_step_targets_match_a_numpy_reference():
    rng = np.random.default_rng(0)
    networks = dpg.networks_of(dpg.Args(critic_hiddens=(5, 4), actor_hiddens=(4, 3)), SPACES)
    obs = rng.normal(size=(6, 3)).astype(np.float32)
    action = rng.uniform(-1, 0, size=(6, 2)).astype(np.float32)
    key = jax.random.PRNGKey(0)
    critic = random_params(networks.critic, key, obs, action)
    actor = random_params(networks.actor, jax.random.fold_in(key, 1), obs)
    target = {
        "critic": random_params(networks.critic, jax.random.fold_in(key, 2), obs, action),
        "actor": random_params(networks.actor, jax.random.fold_in(key, 3), obs),
    }
    batch = dpg.Batch(
        obs=obs,
        actions=action,
        returns=rng.normal(size=6).astype(np.float32),
        discounts=np.array([0.0, 0.9**3, 0.9, 0.9**2, 0.0, 0.9**3], np.float32),
        next_obs=rng.normal(size=(6, 3)).astype(np.float32),
        weights=rng.uniform(0.2, 1.0, size=6).astype(np.float32),
    )
    low = np.array(SPACES.action_low)
    high = np.array(SPACES.action_high)
    # G = R + discount q⁻(s', π⁻(s')); ½ w (G - q(s, a))² and -q(s, π(s)) summed over the batch
    # and divided by the global batch (12: this device holds half of it).
    next_q = numpy_critic(
        target["critic"], batch.next_obs, numpy_actor(target["actor"], batch.next_obs, low, high)
    )
    expected_targets = batch.returns + batch.discounts * next_q
    expected_td = expected_targets - numpy_critic(critic, obs, action)
    expected_critic_loss = np.sum(batch.weights * 0.5 * expected_td**2) / 12
    policy_actions = numpy_actor(actor, obs, low, high)
    assert (policy_actions >= low).all() and (policy_actions <= high).all()
    expected_actor_loss = -np.sum(numpy_critic(critic, obs, policy_actions)) / 12

    targets = dpg.n_step_targets(
        batch,
        target_actor_apply=networks.actor.apply,
        target_critic_apply=networks.critic.apply,
        target_params=target,
    )
    np.testing.assert_allclose(targets, expected_targets, rtol=1e-5, atol=1e-6)
    loss, (td, _) = dpg.critic_loss(
        critic,
        critic_apply=networks.critic.apply,
        batch=batch,
        targets=targets,
        batch_size=12,
    )
    np.testing.assert_allclose(td, expected_td, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, expected_critic_loss, rtol=1e-5)
    _, actor_stats = dpg.actor_loss(
        actor,
        actor_apply=networks.actor.apply,
        critic_apply=networks.critic.apply,
        critic_params=critic,
        batch=batch,
        batch_size=12,
        dqda_clip=1.0,
    )
    np.testing.assert_allclose(actor_stats.policy_q_loss, expected_actor_loss, rtol=1e-5)


def test_relu_after_the_first_layers_matches_numpy():
    args = dpg.Args(critic_hiddens=(5, 4), actor_hiddens=(4, 3), first_activation="relu")
    networks = dpg.networks_of(args, SPACES)
    rng = np.random.default_rng(2)
    obs = rng.normal(size=(6, 3)).astype(np.float32)
    action = rng.uniform(-1, 0, size=(6, 2)).astype(np.float32)
    key = jax.random.PRNGKey(3)
    critic = random_params(networks.critic, key, obs, action)
    actor = random_params(networks.actor, jax.random.fold_in(key, 1), obs)
    low = np.array(SPACES.action_low)
    high = np.array(SPACES.action_high)
    q = networks.critic.apply(critic, obs, action)
    np.testing.assert_allclose(q, numpy_critic(critic, obs, action, numpy_relu), rtol=1e-5)
    assert not np.allclose(q, numpy_critic(critic, obs, action), rtol=1e-3)
    policy = networks.actor.apply(actor, obs)
    np.testing.assert_allclose(policy, numpy_actor(actor, obs, low, high, numpy_relu), rtol=1e-5)
    assert not np.allclose(policy, numpy_actor(actor, obs, low, high), rtol=1e-3)


def test_the_actor_follows_dq_da_clipped_element_wise():
    # dq/da by central differences of the NumPy critic at the policy's actions, clipped at its
    # median magnitude (so that the clip binds on half the components); the actor's gradient must
    # be that of -Σ clip(dq/da)·π(s) / batch, and without a clip that of -Σ q(s, π(s)) / batch.
    networks = dpg.networks_of(dpg.Args(critic_hiddens=(5, 4), actor_hiddens=(4, 3)), SPACES)
    rng = np.random.default_rng(1)
    obs = rng.normal(size=(6, 3)).astype(np.float32)
    key = jax.random.PRNGKey(2)
    critic = random_params(networks.critic, key, obs, np.zeros((6, 2), np.float32))
    actor = random_params(networks.actor, jax.random.fold_in(key, 1), obs)
    batch = dpg.Batch(
        obs=obs, actions=None, returns=None, discounts=None, next_obs=None, weights=None
    )
    low = np.array(SPACES.action_low)
    high = np.array(SPACES.action_high)
    critic64 = jax.tree.map(lambda x: np.asarray(x, np.float64), critic)
    actions = numpy_actor(actor, obs, low, high).astype(np.float64)
    dqda = np.zeros_like(actions)
    for j in range(actions.shape[1]):
        step = np.zeros_like(actions)
        step[:, j] = 1e-4
        dqda[:, j] = (
            numpy_critic(critic64, obs, actions + step)
            - numpy_critic(critic64, obs, actions - step)
        ) / 2e-4
    clip = float(np.median(np.abs(dqda)))
    expected_dqda = np.clip(dqda, -clip, clip)

    def gradient(dqda_clip):
        (_, stats), grads = jax.value_and_grad(dpg.actor_loss, has_aux=True)(
            actor,
            actor_apply=networks.actor.apply,
            critic_apply=networks.critic.apply,
            critic_params=critic,
            batch=batch,
            batch_size=12,
            dqda_clip=dqda_clip,
        )
        return grads, stats

    def reference(loss):
        return jax.grad(loss)(actor)

    def largest(grads):
        return max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads))

    clipped, stats = gradient(clip)
    expected = reference(lambda p: -(expected_dqda * networks.actor.apply(p, obs)).sum() / 12)
    assert max_abs_difference(clipped, expected) < 1e-4 * largest(expected)
    np.testing.assert_allclose(stats.dqda_clipped, np.mean(np.abs(dqda) > clip))
    unclipped, stats = gradient(1e9)
    expected = reference(
        lambda p: -networks.critic.apply(critic, obs, networks.actor.apply(p, obs)).sum() / 12
    )
    assert max_abs_difference(unclipped, expected) < 1e-5 * largest(expected)
    assert stats.dqda_clipped == 0
    # The clip changes the direction, not only the length: the two gradients are not parallel.
    flat_clipped = np.concatenate([np.ravel(g) for g in jax.tree.leaves(clipped)])
    flat_unclipped = np.concatenate([np.ravel(g) for g in jax.tree.leaves(unclipped)])
    cosine = (
        flat_clipped
        @ flat_unclipped
        / np.linalg.norm(flat_clipped)
        / np.linalg.norm(flat_unclipped)
    )
    assert cosine < 0.999


def test_the_update_clips_the_actors_gradient_and_copies_the_targets():
    # One call of two steps, with the clip at 0.01 (so that some of dq/da's components exceed it)
    # and without: the actor moves otherwise (Adam's first step is lr x sign(g) either
    # way, its second is not), the critic alike; the target copy falls on step 2 of a period of 2.
    rng = np.random.default_rng(0)
    device = jax.local_devices()[0]
    spaces = dpg.spaces_of(dpg.Args(env_id="Hopper-v4"))
    batches = dpg.Batch(
        obs=rng.normal(size=(1, 2, 4, spaces.obs_dim)).astype(np.float32),
        actions=rng.uniform(-1, 1, size=(1, 2, 4, 3)).astype(np.float32),
        returns=np.ones((1, 2, 4), np.float32),
        discounts=np.full((1, 2, 4), 0.9, np.float32),
        next_obs=rng.normal(size=(1, 2, 4, spaces.obs_dim)).astype(np.float32),
        weights=np.ones((1, 2, 4), np.float32),
    )
    results = {}
    for clip in [0.01, 1e9]:
        args = dpg.Args(
            env_id="Hopper-v4",
            critic_hiddens=(8, 8),
            actor_hiddens=(8, 8),
            batch_size=4,
            steps_per_call=2,
            updates_per_rollout=2,
            target_update_period=2,
            actor_grad_clip=clip,
        )
        state = dpg.init_state(args, dpg.sizes_of(args, 1), dpg.make_replay(args, spaces))[
            1
        ].learner
        critic = random_params(
            dpg.networks_of(args, spaces).critic,
            jax.random.PRNGKey(1),
            batches.obs[0, 0],
            batches.actions[0, 0],
        )
        state = state.replace(critic=state.critic.replace(params=critic))
        update_fn = dpg.make_update(args, [device])
        new_state, metrics, td = update_fn(replicate(state, [device]), batches)
        assert td.shape == (1, 2, 4)
        results[clip] = (jax.device_get(new_state), jax.device_get(metrics))
    clipped, clipped_metrics = results[0.01]
    unclipped, unclipped_metrics = results[1e9]
    assert clipped_metrics["actor_grad_clipped"][0] > 0
    assert unclipped_metrics["actor_grad_clipped"][0] == 0
    assert max_abs_difference(clipped.actor.params, unclipped.actor.params) > 1e-6
    assert max_abs_difference(clipped.critic.params, unclipped.critic.params) == 0
    for state in (clipped, unclipped):
        assert state.critic.step[0] == 2 and state.actor.step[0] == 2
        assert max_abs_difference(state.target_params["actor"], state.actor.params) == 0
        assert max_abs_difference(state.target_params["critic"], state.critic.params) == 0


def envpool_stream(rng, num_steps: int, max_length: int = 8):
    """One environment as envpool plays it: episodes of random length ending in a termination or a
    truncation, each followed by a reset step (action ignored, reward 0) whose input observation is
    the ended episode's last. Observations are [step index, 0, 0]: unique, so a transition's
    observations can be traced back to their steps."""
    steps = dict(rewards=[], terminations=[], truncations=[], is_reset=[])
    length = rng.integers(1, max_length)
    in_episode = 0
    next_is_reset = False
    for _ in range(num_steps):
        steps["is_reset"].append(next_is_reset)
        ended = not next_is_reset and in_episode + 1 >= length
        terminated = ended and rng.random() < 0.5
        steps["terminations"].append(terminated)
        steps["truncations"].append(ended and not terminated)
        steps["rewards"].append(0.0 if next_is_reset else float(rng.normal()))
        if next_is_reset:
            in_episode = 0
            length = rng.integers(1, max_length)
        else:
            in_episode += 1
        next_is_reset = ended
    stream = {key: np.array(value) for key, value in steps.items()}
    stream["obs"] = np.stack([np.arange(num_steps), np.zeros(num_steps), np.zeros(num_steps)], 1)
    stream["q_taken"] = rng.normal(size=num_steps)
    stream["q_policy"] = rng.normal(size=num_steps)
    return stream


def reference_transition(stream, t: int, gamma: float, n: int):
    """(return, discount, bootstrap step, priority) of the transition starting at step t, or None
    for a reset step, written step by step."""
    if stream["is_reset"][t]:
        return None
    total = 0.0
    for k in range(n):
        total += gamma**k * stream["rewards"][t + k]
        if stream["terminations"][t + k]:
            return total, 0.0, t + k + 1, abs(total - stream["q_taken"][t])
        if stream["truncations"][t + k]:
            break
    offset = k + 1
    bootstrap = gamma**offset * stream["q_policy"][t + offset]
    return total, gamma**offset, t + offset, abs(total + bootstrap - stream["q_taken"][t])


def test_rollout_transitions_match_a_step_by_step_reference_across_rollouts():
    rng = np.random.default_rng(0)
    n, length, num_envs, gamma = 3, 5, 3, 0.9
    streams = [envpool_stream(rng, 60) for _ in range(num_envs)]
    assert all(s["terminations"].any() and s["truncations"].any() for s in streams)
    tail = dpg.padding_tail(
        num_envs, n, dpg.Spaces(obs_dim=3, action_low=(0.0,) * 3, action_high=(1.0,) * 3)
    )
    checked = 0
    for start in range(0, 60, length):
        field = lambda key, dtype, start=start: np.stack(
            [s[key][start : start + length] for s in streams]
        ).astype(dtype)
        played = Steps(
            obs=field("obs", np.float32),
            env_actions=field("obs", np.float32),
            outputs=dpg.CriticValues(
                q_taken=field("q_taken", np.float32), q_policy=field("q_policy", np.float32)
            ),
            # Rewards as envpool gives them: float64.
            rewards=field("rewards", np.float64),
            terminations=field("terminations", bool),
            truncations=field("truncations", bool),
            is_reset=field("is_reset", bool),
        )
        data, tail = dpg.rollout_data(played, tail=tail, gamma=gamma, n=n)
        assert data.obs.shape == (num_envs, length, 3)
        for env, stream in enumerate(streams):
            for position in range(length):
                t = start - n + position
                reference = None if t < 0 else reference_transition(stream, t, gamma, n)
                assert data.valid[env, position] == (reference is not None)
                if reference is None:
                    continue
                total, discount, bootstrap, priority = reference
                assert data.obs[env, position, 0] == t
                assert data.actions[env, position, 0] == t  # the step's own action
                assert data.next_obs[env, position, 0] == bootstrap
                np.testing.assert_allclose(data.returns[env, position], total, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(data.discounts[env, position], discount, rtol=1e-6)
                np.testing.assert_allclose(data.priorities[env, position], priority, rtol=1e-4)
                checked += 1
    assert checked > 100


def test_exploration_noise_scales_with_the_bounds_is_clipped_and_keyed_by_global_env():
    np.testing.assert_allclose(dpg.noise_stds_of(np.arange(4), 4, 0.3, 0.0), 0.3)
    np.testing.assert_allclose(dpg.noise_stds_of([0, 3], 4, 0.3, 7.0), [0.3, 0.3**8])
    bounds = ((-2.0, -2.0), (2.0, 0.0))
    key = jax.random.PRNGKey(0)
    explore = jax.jit(
        lambda actions, stds, step, env_ids, random_actions=False: dpg.explore(
            actions,
            stds=stds,
            bounds=bounds,
            key=key,
            step=step,
            env_ids=env_ids,
            random_actions=random_actions,
        )
    )
    # Dimension 0 (half range 2) from its middle: the noise's std is 0.3 x 2. Dimension 1 (half
    # range 1) from its upper bound: half the draws are clipped to it.
    policy = jnp.tile(jnp.array([0.0, 0.0]), (6, 1))
    ids = jnp.arange(6)
    draws = np.concatenate([explore(policy, jnp.full(6, 0.3), step, ids) for step in range(400)])
    assert abs(draws[:, 0].std() - 0.6) < 0.03 and abs(draws[:, 0].mean()) < 0.04
    assert draws[:, 1].max() == 0.0 and 0.45 < np.mean(draws[:, 1] == 0.0) < 0.55
    # The same draws however the environments are split between threads.
    stds = jnp.linspace(0.1, 0.3, 6)
    halves = [explore(policy[:3], stds[k : k + 3], 9, ids[k : k + 3]) for k in (0, 3)]
    np.testing.assert_array_equal(explore(policy, stds, 9, ids), np.concatenate(halves))
    np.testing.assert_array_equal(explore(policy, jnp.zeros(6), 9, ids), policy)
    # --random-steps: uniform over the bounds, whatever the policy and noise, keyed the same way.
    uniform = np.concatenate([explore(policy, stds, step, ids, True) for step in range(400)])
    assert uniform.min(axis=0).tolist() >= [-2.0, -2.0] and uniform.max(axis=0).tolist() <= [2, 0]
    np.testing.assert_allclose(uniform.mean(axis=0), [0.0, -1.0], atol=0.06)
    np.testing.assert_allclose(uniform.std(axis=0), [4 / 12**0.5, 2 / 12**0.5], rtol=0.04)
    halves = [explore(policy[:3], stds[k : k + 3], 9, ids[k : k + 3], True) for k in (0, 3)]
    np.testing.assert_array_equal(explore(policy, stds, 9, ids, True), np.concatenate(halves))


def small_replay(capacity: int, eviction: str = "prioritized"):
    args = dpg.Args(env_id="Hopper-v4", buffer_size=capacity, eviction=eviction)
    return dpg.make_replay(args, SPACES)


def transitions(values, valid, priorities) -> dpg.Transitions:
    """One environment's transitions whose fields all hold `values` (to trace them)."""
    values = np.asarray(values, np.float32)[None]
    return dpg.Transitions(
        obs=np.repeat(values[..., None], 3, axis=2),
        actions=np.repeat(values[..., None], 2, axis=2),
        returns=values,
        discounts=values,
        next_obs=np.repeat(values[..., None], 3, axis=2) + 0.5,
        valid=np.asarray(valid, bool)[None],
        priorities=np.asarray(priorities, np.float32)[None],
    )


def test_only_valid_transitions_enter_and_a_full_replay_evicts_by_the_written_priorities():
    # What the module's own tests (tests/test_replay.py: the law of one eviction, several at once)
    # do not cover: the script inserts only valid transitions, with |TD| + epsilon as priority; the
    # learner's TD errors rewrite both the sampling and the eviction weights (a slot drawn twice in
    # one call gets the later step's); then eviction follows priority ** -0.4, checked against the
    # law computed by hand from those priorities.
    replay = small_replay(6)
    inserted = dpg.replay_insert(
        replay,
        transitions(np.arange(8), [1, 0, 1, 1, 1, 0, 1, 1], np.arange(8) / 10),
        rng=np.random.default_rng(0),
    )
    assert inserted == 6 and replay.size == 6
    np.testing.assert_array_equal(replay.items.returns, [0, 2, 3, 4, 6, 7])
    np.testing.assert_array_equal(replay.items.next_obs[:, 0], [0.5, 2.5, 3.5, 4.5, 6.5, 7.5])
    np.testing.assert_allclose(
        replay.priorities(), np.array([0, 2, 3, 4, 6, 7]) / 10 + dpg.PRIORITY_EPSILON, rtol=1e-6
    )
    # A call of two steps whose batches drew slot 1 twice: the second step's TD error counts.
    slots = np.array([[0, 1, 2], [1, 3, 4]])
    td = np.array([[0.5, -3.0, 0.2], [-2.0, 1.5, -0.05]], np.float32)
    pending = PendingPriorities(
        slots=slots, inserted=replay.inserted, td=replicate(td, jax.local_devices()[:1])
    )
    write_priorities(replay, pending)
    priorities = np.array([0.5, 2.0, 0.2, 1.5, 0.05, 0.7]) + dpg.PRIORITY_EPSILON
    np.testing.assert_allclose(replay.priorities(), priorities, rtol=1e-6)
    expected = priorities**-0.4 / (priorities**-0.4).sum()
    saved = replay.snapshot()
    evicted = []
    rng = np.random.default_rng(1)
    for _ in range(3000):
        trial = small_replay(6)
        trial.restore(saved)
        dpg.replay_insert(trial, transitions([99], [1], [1.0]), rng=rng)
        evicted.append(int(np.flatnonzero(trial.items.returns == 99)[0]))
    counts = np.bincount(evicted, minlength=6)
    assert stats.chisquare(counts, 3000 * expected).pvalue > 1e-3
    # The test can tell the wrong law: eviction in proportion to the priority itself.
    wrong = priorities / priorities.sum()
    assert stats.chisquare(counts, 3000 * wrong).pvalue < 1e-6
    # FIFO evicts the oldest.
    fifo = small_replay(6, eviction="fifo")
    dpg.replay_insert(fifo, transitions(np.arange(8), np.ones(8), np.ones(8)), rng=None)
    np.testing.assert_array_equal(np.sort(fifo.items.returns), np.arange(2, 8))


def test_a_checkpointed_replay_continues_with_the_same_samples_and_evictions():
    rng = np.random.default_rng(2)
    replay = small_replay(50)
    for update in range(6):
        data = transitions(rng.normal(size=20), rng.random(20) < 0.8, rng.uniform(0.1, 2, 20))
        dpg.replay_insert(replay, data, rng=np.random.default_rng([1, 4, update]))
    # Through the checkpoint's serialization, into a fresh replay.
    saved = flax.serialization.msgpack_restore(
        flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(replay.snapshot()))
    )
    restored = small_replay(50)
    restored.restore(flax.serialization.from_state_dict(small_replay(50).snapshot(), saved))
    assert restored.size == replay.size == 50 and restored.inserted == replay.inserted
    np.testing.assert_array_equal(restored.tree, replay.tree)
    np.testing.assert_array_equal(restored.eviction_tree, replay.eviction_tree)
    data = transitions(np.arange(20) + 100, np.ones(20), np.ones(20))
    for store in (replay, restored):
        dpg.replay_insert(store, data, rng=np.random.default_rng(5))
    np.testing.assert_array_equal(restored.items.returns, replay.items.returns)
    for step in range(3):
        samples = [
            store.sample(16, np.random.default_rng([1, 3, step]), beta=0.4)
            for store in (replay, restored)
        ]
        np.testing.assert_array_equal(samples[0].slots, samples[1].slots)
        np.testing.assert_array_equal(samples[0].weights, samples[1].weights)


# 4 envs x 8 steps per update, 16 updates; Hopper's random-policy episodes end within dozens of
# steps, so reset steps and terminations occur. The replay (256) fills by update 9 and then evicts.
MODEL = "cleanba_apex_dpg.cleanba_model"
TINY = [
    "--env-id",
    "Hopper-v4",
    "--critic-hiddens",
    32,
    32,
    "--actor-hiddens",
    32,
    32,
    "--local-num-envs",
    4,
    "--num-actor-threads",
    1,
    "--num-steps",
    8,
    "--total-timesteps",
    512,
    "--learning-starts",
    64,
    "--random-steps",
    48,
    "--buffer-size",
    256,
    "--batch-size",
    32,
    "--updates-per-rollout",
    4,
    "--steps-per-call",
    2,
    "--target-update-period",
    4,
    "--log-frequency",
    1,
    "--checkpoint-every",
    8,
    "--save-model",
]

# Runs the script's main once per command, in one process (an import of JAX and envpool takes ~8 s
# of CPU here). A command may first copy another run's checkpoints up to an update, to resume from
# there.
DRIVER = """
import json
import shutil
import sys
from pathlib import Path

import cleanba.cleanba_apex_dpg as script

sys.path.insert(0, sys.argv[2])
from preempt import run_command  # noqa: E402

for command in json.loads(sys.argv[1]):
    run_dir = Path("runs") / command["name"]
    if command.get("resume_from"):
        source, update = command["resume_from"]
        shutil.copytree(Path("runs") / source / "checkpoints", run_dir / "checkpoints")
        for checkpoint in (run_dir / "checkpoints").glob("*.ckpt"):
            if int(checkpoint.stem.split("_")[1]) > update:
                checkpoint.unlink()
    run_command(script, command)
"""

EVAL = ["--no-pipeline", "--eval-episodes", 1, "--eval-every", 5]
# The README's command with fewer steps: 3 updates of 64 environments x 40 steps, 2 of them
# learning (16 optimizer steps of 256 each).
README_SHORTER = ["--total-timesteps", 7680, "--learning-starts", 2560, "--checkpoint-every", 0]
PROCESSES = [
    [
        dict(name="one", argv=TINY),
        dict(name="two_threads", argv=[*TINY, "--local-num-envs", 2, "--num-actor-threads", 2]),
        dict(name="resumed_at_end", argv=[*TINY, "--resume"], resume_from=["one", 16]),
        dict(name="resumed", argv=[*TINY, "--resume"], resume_from=["one", 8]),
        dict(name="readme", argv=[]),
        dict(name="sync", argv=[*TINY, "--no-concurrency"]),
    ],
    [
        dict(name="one_again", argv=TINY),
        dict(name="two_learners", argv=[*TINY, "--learner-device-ids", 0, 1]),
        dict(name="serial_eval", argv=[*TINY, *EVAL]),
        dict(name="no_replay", argv=[*TINY, "--no-checkpoint-replay"]),
        dict(
            name="resumed_empty",
            argv=[*TINY, "--resume", "--no-checkpoint-replay"],
            resume_from=["no_replay", 8],
        ),
        dict(name="preempted", argv=TINY, preempted_after=5),
        dict(name="sync_preempted", argv=[*TINY, "--no-concurrency"], preempted_after=11),
    ],
]


def readme_command() -> list[str]:
    """The Ape-X DPG command of docs/apex_dpg.md, as the script's arguments."""
    readme = (REPO / "docs" / "apex_dpg.md").read_text()
    section = readme[readme.index("## Running it") :]
    block = section[section.index("```bash") + len("```bash") : section.index("```\n", 10)]
    lines = block.replace("\\\n", " ").splitlines()
    command = next(line.split() for line in lines if "cleanba_apex_dpg.py" in line)
    return command[command.index("cleanba/cleanba_apex_dpg.py") + 1 :]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directory and stdout of each run; both processes see 2 CPU devices."""
    cwd = tmp_path_factory.mktemp("apex_dpg")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    processes = []
    for commands in PROCESSES:
        resolved = []
        for command in commands:
            argv = command["argv"] if command["name"] != "readme" else readme_command()
            if command["name"] == "readme":
                argv = [*argv, *README_SHORTER]
            resolved.append(dict(command, argv=[*map(str, argv)]))
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", DRIVER, json.dumps(resolved), str(REPO / "tests")],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    stdout = ""
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        stdout += out
    return cwd / "runs", stdout


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_same_seed_same_fingerprint_with_or_without_pipeline_and_evaluation(runs):
    run_dirs, _ = runs
    fingerprints = {
        name: summary(run_dirs / name)["params_fingerprint"]
        for name in ["one", "one_again", "serial_eval", "no_replay"]
    }
    assert len(set(fingerprints.values())) == 1, fingerprints
    evaluations = scalars(run_dirs / "serial_eval", "charts/eval_return")
    assert [step for step, _ in evaluations] == [0, 160, 320, 480, 512]
    assert scalars(run_dirs / "serial_eval", "charts/opt_step")[0] == (0, 0)
    assert summary(run_dirs / "serial_eval")["eval_return"] == pytest.approx(evaluations[-1][1])


# The same run under two layouts differs by float rounding only: measured after 16 updates, 1 vs 2
# learner devices (gradients summed in another order) and 1 vs 2 actor threads (the actors' networks
# on batches of 4 or 2), parameters at most 3e-8 apart; asserted with a 30x margin.
LAYOUT_ATOL = 1e-6


@pytest.mark.parametrize("layout", ["two_learners", "two_threads"])
def test_layout_changes_parameters_by_float_rounding_only(runs, layout):
    run_dirs, _ = runs
    reference = load_params(run_dirs / "one" / MODEL)
    other = load_params(run_dirs / layout / MODEL)
    assert max_abs_difference(reference, other) < LAYOUT_ATOL


def test_the_run_logs_its_diagnostics_and_keeps_the_policy_lag(runs):
    run_dir = runs[0] / "one"
    expected = {
        "charts/SPS",
        "charts/episodic_return",
        "stats/actor_sps",
        "stats/optimizer_steps_per_second",
        "stats/replay_size",
        "stats/priority_mean",
        "stats/priority_max",
        "stats/is_weight_min",
        "stats/noise_std_max",
        "stats/param_lag",
        "losses/critic_loss",
        "losses/actor_loss",
        "losses/q_values",
        "losses/actor_grad_clipped",
    }
    assert expected <= scalar_tags(run_dir)
    assert [v for _, v in scalars(run_dir, "stats/param_lag")] == [0] + [1] * 15
    # Updates of 32 steps; the first rollout's last 3 steps per env wait for the next one, and
    # reset steps never enter: the replay grows by at most 32 an update until it holds 256.
    sizes = [v for _, v in scalars(run_dir, "stats/replay_size")]
    assert sizes[0] <= 20 and sizes[-1] == 256 and all(np.diff(sizes) <= 32)
    updates = [v for _, v in scalars(run_dir, "stats/optimizer_steps")]
    assert updates[-1] == 4 * sum(size >= 64 for size in sizes)


def test_the_first_random_steps_play_uniform_actions(runs):
    # TINY's --random-steps 48 over 4 environments: each environment's first 12 steps, the second
    # rollout's switch included. The uniform draws do not depend on the policy, so each can be
    # recomputed and looked for in the replay saved after update 8 (nothing evicted yet).
    path = sorted((runs[0] / "one" / "checkpoints").glob("*.ckpt"))[0]
    assert path.stem == "update_000000008"
    payload = path.read_bytes()[checkpoints.CHECKSUM_BYTES :]
    saved = flax.serialization.msgpack_restore(payload)["state"]
    replayed = saved["replay"]["items"]["actions"]
    args = dpg.parse_args([*map(str, TINY)])
    draws = {}
    for step in range(16):
        uniform = dpg.explore(
            jnp.zeros((4, 3)),
            stds=jnp.zeros(4),
            bounds=(-np.ones(3), np.ones(3)),
            key=jax.random.fold_in(jax.random.PRNGKey(args.seed), 1),
            step=step,
            env_ids=jnp.arange(4),
            random_actions=True,
        )
        for env in range(4):
            draws[step, env] = np.asarray(uniform[env])
    found = [
        key for key, draw in draws.items() if np.any(np.all(np.isclose(replayed, draw), axis=1))
    ]
    assert found and all(step < 12 for step, _ in found), found
    # All 48 random steps but the reset steps, which never enter the replay.
    assert len(found) >= 40, len(found)


def test_the_model_file_plays_as_the_run_evaluated_it(runs):
    run_dir = runs[0] / "serial_eval"
    args = dpg.parse_args([*map(str, TINY)])
    returns = dpg.evaluate(load_params(run_dir / MODEL), args, 1, args.seed + 1_000_000)
    np.testing.assert_allclose(returns, [v for _, v in scalars(run_dir, "eval/episodic_return")])


def test_resume_continues_with_the_checkpointed_replay(runs):
    run_dirs, stdout = runs
    assert "resuming resumed_at_end from update 16" in stdout
    assert (
        summary(run_dirs / "resumed_at_end")["params_fingerprint"]
        == (summary(run_dirs / "one")["params_fingerprint"])
    )
    # Resumed after update 8 with its replay, the run learns at update 9 as the uninterrupted run
    # did; with an empty replay it waits until the replay holds 64 transitions again.
    assert "resuming resumed from update 8" in stdout
    one = dict(scalars(run_dirs / "one", "stats/optimizer_steps"))
    resumed = dict(scalars(run_dirs / "resumed", "stats/optimizer_steps"))
    empty = dict(scalars(run_dirs / "resumed_empty", "stats/optimizer_steps"))
    assert resumed[9 * 32] == one[9 * 32] == one[8 * 32] + 4
    assert empty[9 * 32] == one[8 * 32]
    assert resumed[16 * 32] == one[16 * 32]


@pytest.mark.parametrize(
    "name,source,update", [("preempted", "one", 5), ("sync_preempted", "sync", 11)]
)
def test_a_preempted_and_resumed_run_repeats_the_uninterrupted_one(runs, name, source, update):
    # SIGTERM during update k: the checkpoint of update k holds the learner, the replay, the last
    # call's pending priorities, the parameters the actors play their next rollout with, and per
    # environment what it did since its last reset and its tail (the steps whose n-step returns
    # wait for the next rollout): the resumed run gives the same parameters, bit for bit.
    assert_resumed_as_uninterrupted(*runs, name=name, source=source, update=update)


def test_the_readme_command_runs_with_its_defaults_for_fewer_steps(runs):
    run_dir = runs[0] / "readme"
    assert summary(run_dir)["global_step"] == 7680
    assert scalars(run_dir, "stats/optimizer_steps")[-1][1] == 32


def test_a_crashing_actor_ends_the_process(tmp_path):
    args = [*TINY, "--total-timesteps", 1_000_000, "--checkpoint-every", 0]
    result = run_failing("cleanba_apex_dpg", "actor", args, tmp_path)
    assert result.returncode == 1 and "environment exploded" in result.stderr
    assert seconds_after_failure(result, time.time()) < PROMPT_EXIT_SECONDS


def test_a_crashing_replay_thread_ends_the_process(tmp_path):
    program = (
        "import sys\nimport time\nimport cleanba.cleanba_apex_dpg as script\n"
        "def exploding_sample(*args):\n"
        "    print(f'failed at {time.time()}', file=sys.stderr, flush=True)\n"
        "    raise RuntimeError('sampler exploded')\n"
        "script.sample_batches = exploding_sample\nscript.main(sys.argv[1:])\n"
    )
    args = [*TINY, "--total-timesteps", 1_000_000, "--checkpoint-every", 0]
    result = subprocess.run(
        [sys.executable, "-c", program, *map(str, args)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "sampler exploded" in result.stderr, result.stderr[-3000:]
    assert seconds_after_failure(result, time.time()) < PROMPT_EXIT_SECONDS


def test_a_discrete_task_is_one_line_and_exit_2_in_a_real_process(tmp_path):
    result = run_script("cleanba_apex_dpg.py", ["--env-id", "CartPole-v1"], tmp_path, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cleanba_apex_dqn.py" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()


BAD_INPUTS = [
    (["--env-id", "NoSuchTask-v4"], "--env-id"),
    (["--env-id", "Breakout-v5"], "cleanba_apex_dqn.py"),
    (["--total-timesteps", "0"], "--total-timesteps"),
    (["--learning-rate", "nan"], "--learning-rate"),
    (["--noise-std", "inf"], "--noise-std"),
    (["--noise-std", "1.5"], "--noise-std"),
    (["--gamma", "1.5"], "--gamma"),
    (["--n-step", "0"], "--n-step"),
    (["--batch-size", "0"], "--batch-size"),
    (["--updates-per-rollout", "6", "--steps-per-call", "4"], "--steps-per-call"),
    (["--target-update-period", "0"], "--target-update-period"),
    (["--actor-grad-clip", "0"], "--actor-grad-clip"),
    (["--priority-exponent", "-1"], "--priority-exponent"),
    (["--importance-sampling-exponent", "1.5"], "--importance-sampling-exponent"),
    (["--eviction", "lifo"], "--eviction"),
    (["--eviction-exponent", "0.4"], "--eviction-exponent"),
    (["--learning-starts", "100", "--buffer-size", "50"], "--learning-starts"),
    (["--buffer-size", str(10**10)], "--buffer-size"),
    (["--critic-hiddens"], "--critic-hiddens"),
    (["--actor-hiddens", "0"], "--actor-hiddens"),
    (["--learner-device-ids", "7"], "--learner-device-ids"),
    (["--resume"], "--resume"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--random-steps", "-1"], "--random-steps"),
]


@pytest.mark.parametrize("args,option", BAD_INPUTS)
def test_bad_input_is_refused_with_one_line(capsys, args, option):
    assert_refused(dpg, args, option, capsys)
