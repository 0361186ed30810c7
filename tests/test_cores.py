"""Recurrent cores (`--core lstm|gru`, cleanba_utils/cores.py): the core over a sequence steps as a
plain loop over flax's cell does, resets inside included; the learner replays exactly what the actor
computed, step by step, in both rollout paths (a JAX environment's compiled rollout, envpool's
splits); the run's contract (its fingerprint twice, a layout, a resume, a saved model's evaluation)
and the options' checks."""

import functools
import types
from collections import deque

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PPO_LAYOUT_ATOL,
    PPO_LAYOUTS,
    assert_refused,
    evaluate_saved_model,
    fingerprint_of,
    max_abs_difference,
    ppo_params_by_layout,
    run_script,
    scalars,
)
from preempt import assert_a_resumed_run_is_the_whole_one

from cleanba import cleanba_impala, cleanba_ppo, cleanba_ppo_continuous
from cleanba_utils import compiled_rollout, cores, split_envs
from cleanba_utils.envs import make_env
from cleanba_utils.episodes import Episodes


class Writer:
    def add_scalar(self, key, value, step):
        pass


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_core_steps_a_sequence_as_a_plain_loop_over_the_cell(kind):
    """Seven steps of three environments from a state that is not zero, with reset steps inside:
    after a reset step the next step starts from zeros; the cell's own step (flax's) in a Python
    loop is the reference."""
    steps, envs, features, size = 7, 3, 5, 6
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (steps, envs, features))
    is_reset = np.zeros((steps, envs), bool)
    is_reset[2, 0] = is_reset[2, 2] = is_reset[5, 1] = True
    zeros = cores.initial_state(kind, size, envs)
    first_state = jax.tree.map(lambda z: jax.random.normal(keys[1], z.shape), zeros)
    core = cores.Core(kind, size)
    params = core.init(keys[2], first_state, x, is_reset)
    last_state, outputs = core.apply(params, first_state, x, is_reset)

    cell = nn.OptimizedLSTMCell(size) if kind == "lstm" else nn.GRUCell(size)
    cell_params = {"params": params["params"]["cell"][f"{type(cell).__name__}_0"]}
    state = jax.tree.map(np.asarray, first_state)
    for t in range(steps):
        state, y = cell.apply(cell_params, state, x[t])
        np.testing.assert_allclose(outputs[t], y, rtol=1e-5, atol=1e-6)
        for env in np.flatnonzero(is_reset[t]):
            state = jax.tree.map(lambda s, e=env: np.asarray(s).copy(), state)
            for part in jax.tree.leaves(state):
                part[env] = 0.0
    for expected, got in zip(jax.tree.leaves(state), jax.tree.leaves(last_state), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # The reset steps' states were not zero before their reset: the rule acted.
    assert all(np.abs(np.asarray(s)).sum() > 0 for s in jax.tree.leaves(first_state))


def rollout_args(env_id: str, **options):
    return types.SimpleNamespace(
        env_id=env_id,
        env_params=(),
        envpool_num_threads=None,
        num_actor_threads=1,
        actor_device_ids=(0,),
        **options,
    )


def ppo_network_and_params(env_id: str, kind: str):
    envs = make_env(rollout_args(env_id, seed=0), 0, 1)
    network = cleanba_ppo.Network((), (16,), envs.action_space.n, core=kind, core_size=8)
    params = cores.init_network(network, jax.random.PRNGKey(3), envs.reset()[0])
    envs.close()
    return network, params


ROLLOUT_PATHS = {
    "compiled (gymnax)": ("gymnax:CartPole-v1", compiled_rollout.start, {}),
    "splits (envpool)": ("CartPole-v1", split_envs.start_splits, {"env_splits": 2}),
}


@pytest.mark.parametrize("path", ROLLOUT_PATHS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_learner_replays_what_the_actor_played(path, kind):
    """PPO's policy step played by a rollout path, two rollouts of 32 steps of 4 CartPole
    environments acting at random (episodes of about 20 steps: resets inside both): the network
    over each environment's whole sequence, from the state its first step met, gives the actor's
    log-probabilities and values and its state after the rollout; the second rollout starts where
    the first ended."""
    env_id, start, extra = ROLLOUT_PATHS[path]
    network, params = ppo_network_and_params(env_id, kind)
    num_envs, num_steps = 4, 32
    args = rollout_args(env_id, seed=7, local_num_envs=num_envs, num_steps=num_steps, **extra)
    episodes = Episodes(
        Writer(), deque(maxlen=100), np.zeros(num_envs), np.zeros(num_envs, np.int64)
    )
    rollout = start(
        make_env,
        args,
        episodes=episodes,
        num_envs=num_envs,
        env_offset=0,
        env_record=None,
        act=functools.partial(cleanba_ppo.policy_step, network, jax.random.PRNGKey(1)),
        bootstrap=functools.partial(cleanba_ppo.bootstrap_value, network),
        core_state=cores.initial_state(kind, 8, num_envs),
    )
    plays = [rollout.play(params, update) for update in (1, 2)]
    for a, b in zip(
        jax.tree.leaves(plays[0].next_core_state), jax.tree.leaves(plays[1].first_core_state)
    ):
        np.testing.assert_array_equal(a, b)
    for played in plays:
        steps = played.steps
        assert steps.is_reset[:, 1:-1].any()
        time_major = lambda x: jnp.swapaxes(jnp.asarray(x), 0, 1)
        logits, values, last_state = network.apply(
            params, time_major(steps.obs), played.first_core_state, time_major(steps.is_reset)
        )
        log_probs = jax.nn.log_softmax(time_major(logits))
        logprobs = jnp.take_along_axis(log_probs, steps.env_actions[..., None], axis=-1)[..., 0]
        np.testing.assert_allclose(logprobs, steps.outputs.logprobs, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(time_major(values), steps.outputs.values, rtol=1e-5, atol=1e-5)
        for expected, got in zip(
            jax.tree.leaves(played.next_core_state), jax.tree.leaves(last_state), strict=True
        ):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# MemoryChain's episodes are 6 steps long: a rollout of 16 steps holds reset steps inside.
MEMORY = [
    *["--env-id", "gymnax:MemoryChain-bsuite", "--hiddens", "16", "--core-size", "8"],
    *["--local-num-envs", "4", "--num-actor-threads", "1", "--num-steps", "16"],
    *["--num-minibatches", "2", "--log-frequency", "1"],
]
PPO_MEMORY = [*MEMORY, "--update-epochs", "2", "--gradient-accumulation-steps", "1"]


def test_a_recurrent_run_repeats_its_fingerprint(tmp_path):
    args = [*PPO_MEMORY, "--core", "gru", "--total-timesteps", "256"]
    fingerprints = [fingerprint_of(run_script("cleanba_ppo.py", args, tmp_path)) for _ in "ab"]
    assert fingerprints[0] == fingerprints[1]


RESUMED = {
    "ppo --core lstm": ("cleanba_ppo", [*PPO_MEMORY, "--core", "lstm", "--total-timesteps", "512"]),
    "ppo --core gru --concurrency": (
        "cleanba_ppo",
        [*PPO_MEMORY, "--core", "gru", "--concurrency", "--total-timesteps", "512"],
    ),
    "impala --core lstm": (
        "cleanba_impala",
        [*MEMORY, "--core", "lstm", "--total-timesteps", "512"],
    ),
    "ppo_continuous --core gru": (
        "cleanba_ppo_continuous",
        [
            *["--env-id", "gymnax:Pendulum-v1", "--hiddens", "16", "--core", "gru"],
            *["--core-size", "8", "--local-num-envs", "2", "--num-steps", "50"],
            *["--num-minibatches", "2", "--update-epochs", "2", "--total-timesteps", "800"],
        ],
    ),
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=pytest.mark.long) if "impala" in name else name for name in RESUMED],
)
def test_a_resumed_recurrent_run_is_the_uninterrupted_one(tmp_path, name):
    # The checkpoint holds every environment's core state beside the environments' own.
    script, argv = RESUMED[name]
    assert_a_resumed_run_is_the_whole_one(tmp_path, script, argv, update=5)


# In the long checks (`-m long`): its runs cost the README's test command about 25 s.
@pytest.mark.long
def test_a_layout_changes_a_recurrent_run_by_rounding_only(tmp_path):
    # Each environment's sequence, and the minibatch it joins, depend on its global index alone.
    args = [
        *["--env-id", "gymnax:MemoryChain-bsuite", "--core", "lstm", "--core-size", "8"],
        *["--hiddens", "16", "--num-steps", "16", "--num-minibatches", "2"],
        *["--update-epochs", "2", "--gradient-accumulation-steps", "1", "--total-timesteps", "384"],
    ]
    params = ppo_params_by_layout(tmp_path, args, PPO_LAYOUTS)
    for name in ("two_learners", "two_threads"):
        assert max_abs_difference(params["one_learner"], params[name]) < PPO_LAYOUT_ATOL


def test_a_saved_recurrent_model_is_evaluated_with_its_core(tmp_path):
    """`cleanba_utils.evaluate` plays a saved model with its core, each episode from a zero state,
    as the run's own final evaluation did (the same episodes: CartPole's returns tell them
    apart)."""
    args = [*PPO_MEMORY[2:], "--env-id", "gymnax:CartPole-v1", "--core", "gru"]
    args += ["--total-timesteps", "128", "--save-model", "--eval-episodes", "2"]
    args += ["--run-name", "saved"]
    result = run_script("cleanba_ppo.py", args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "saved"
    evaluation = evaluate_saved_model(run_dir / "cleanba_ppo.cleanba_model")
    assert len(evaluation["returns"]) == 2
    assert sorted(evaluation["returns"]) == sorted(
        value for _, value in scalars(run_dir, "eval/episodic_return")
    )


@pytest.mark.parametrize("script", [cleanba_ppo, cleanba_impala, cleanba_ppo_continuous])
def test_a_core_size_without_a_core_is_refused(capsys, script):
    env_id = "Pendulum-v1" if script is cleanba_ppo_continuous else "CartPole-v1"
    assert_refused(script, ["--env-id", env_id, "--core-size", "64"], "--core-size", capsys)


@pytest.mark.parametrize(
    "script, args",
    [
        (cleanba_ppo, ["--env-id", "CartPole-v1", "--local-num-envs", "6"]),
        (cleanba_ppo_continuous, ["--env-id", "Pendulum-v1"]),
    ],
)
def test_minibatches_that_do_not_divide_the_sequences_are_refused(capsys, script, args):
    # With a core a minibatch holds whole environment sequences (continuous PPO's default: 8
    # environments, 32 minibatches).
    assert_refused(script, [*args, "--core", "lstm"], "--num-minibatches", capsys)
