"""cleanba_impala.py: V-trace against hand-written references, then real short runs in
subprocesses."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    IMPALA_TINY,
    PROMPT_EXIT_SECONDS,
    assert_policy_lag,
    assert_refused,
    evaluate_saved_model,
    fingerprint_of,
    load_params,
    run_failing,
    run_script,
    scalars,
    seconds_after_failure,
)

from cleanba import cleanba_impala as impala
from cleanba_utils.microbatches import minibatch_ids


def python_vtrace(
    values, rewards, terminations, truncations, rhos, gamma, lam, rho_bar, pg_rho_bar
):
    """Espeholt et al. (2018) eq. 1 as the explicit sum, one environment: v_s = V(x_s) +
    sum_{t >= s} gamma^(t-s) (c_s ... c_{t-1}) rho_t delta_t, with c_i = lam min(1, rho_i),
    delta_t = r_t + gamma V(x_{t+1}) - V(x_t), the sum stopping at the episode's last step."""
    num_steps = len(rewards)
    targets = []
    for s in range(num_steps):
        target, weight = values[s], 1.0
        for t in range(s, num_steps):
            bootstrap = 0.0 if terminations[t] else values[t + 1]
            target += weight * min(rho_bar, rhos[t]) * (rewards[t] + gamma * bootstrap - values[t])
            if terminations[t] or truncations[t]:
                break
            weight *= gamma * lam * min(1.0, rhos[t])
        targets.append(target)
    advantages = []
    for s in range(num_steps):
        # The policy gradient bootstraps from v_{s+1}; at a cut trace (episode end or rollout end)
        # only V(x_{s+1}) is left, and lam mixes the two as it does in the targets.
        if terminations[s]:
            next_value = 0.0
        elif truncations[s] or s == num_steps - 1:
            next_value = values[s + 1]
        else:
            next_value = lam * targets[s + 1] + (1 - lam) * values[s + 1]
        advantages.append(min(pg_rho_bar, rhos[s]) * (rewards[s] + gamma * next_value - values[s]))
    return np.array(targets), np.array(advantages)


def run_vtrace(values, rewards, terminations, truncations, rhos, gamma, lam, rho_bar, pg_rho_bar):
    as_array = lambda x: jnp.asarray(np.asarray(x, dtype=np.float32))
    return impala.vtrace(
        values=as_array(values),
        rewards=as_array(rewards),
        terminations=as_array(terminations),
        truncations=as_array(truncations),
        log_rhos=jnp.log(as_array(rhos)),
        gamma=gamma,
        vtrace_lambda=lam,
        clip_rho=rho_bar,
        clip_pg_rho=pg_rho_bar,
    )


@pytest.mark.parametrize("lam,rho_bar,pg_rho_bar", [(1.0, 1.0, 1.0), (0.9, 1.5, 0.8)])
def test_vtrace_matches_python_sum(lam, rho_bar, pg_rho_bar):
    rng = np.random.default_rng(0)
    num_steps = 50
    rewards = rng.normal(size=num_steps)
    values = rng.normal(size=num_steps + 1)
    rhos = np.exp(rng.normal(scale=0.7, size=num_steps))
    terminations = rng.random(num_steps) < 0.1
    truncations = (rng.random(num_steps) < 0.1) & ~terminations
    hyperparameters = dict(gamma=0.99, lam=lam, rho_bar=rho_bar, pg_rho_bar=pg_rho_bar)
    rollout = dict(
        values=values,
        rewards=rewards,
        terminations=terminations,
        truncations=truncations,
        rhos=rhos,
    )
    targets, advantages = run_vtrace(**rollout, **hyperparameters)
    expected_targets, expected_advantages = python_vtrace(**rollout, **hyperparameters)
    np.testing.assert_allclose(targets, expected_targets, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(advantages, expected_advantages, rtol=1e-5, atol=1e-5)


def test_vtrace_hand_computed():
    # gamma 0.5, V = (1, 2, 4, 8), r = (1, 1, 2), rho = (2, 0.5, 1) clipped to (1, 0.5, 1), c = the
    # same. delta_0 = 1 * (1 + 0.5 * 2 - 1) = 1, delta_1 = 0.5 * (1 + 0.5 * 4 - 2) = 0.5, delta_2 =
    # 2 + 0.5 * 8 - 4 = 2. v_2 = 4 + 2 = 6; v_1 = 2 + 0.5 + 0.5 * 0.5 * (6 - 4) = 3; v_0 = 1 + 1 +
    # 0.5 * 1 * (3 - 2) = 2.5. Advantages rho_s (r_s + 0.5 v_{s+1} - V_s): 1 + 1.5 - 1 = 1.5, 0.5 *
    # (1 + 3 - 2) = 1, 2 + 4 - 4 = 2.
    targets, advantages = run_vtrace(
        values=[1, 2, 4, 8],
        rewards=[1, 1, 2],
        terminations=[0, 0, 0],
        truncations=[0, 0, 0],
        rhos=[2.0, 0.5, 1.0],
        gamma=0.5,
        lam=1.0,
        rho_bar=1.0,
        pg_rho_bar=1.0,
    )
    np.testing.assert_allclose(targets, [2.5, 3.0, 6.0], rtol=1e-6)
    np.testing.assert_allclose(advantages, [1.5, 1.0, 2.0], rtol=1e-6)


def test_loss_handles_termination_truncation_and_reset_steps():
    # One environment, on-policy (rho = 1), gamma 0.5: step 1 terminates, step 2 is its reset step
    # (observation: episode 1's last), step 4 is truncated, step 5 is its reset step (observation:
    # episode 2's last), observation 6 starts episode 3. Reset steps carry numbers that must not
    # leak. v_1 = r_1 = 2 (no bootstrap from V_2 = 50); v_0 = 1 + 0.5 * 2 = 2; v_4 = 4 + 0.5 * V_5 =
    # 8 (bootstrap from the truncated episode's last observation); v_3 = 3 + 0.5 * 8 = 7. Advantages
    # v_s - V_s here: 1, 0, 4, 4.
    rewards = jnp.array([[1.0, 2.0, 100.0, 3.0, 4.0, 100.0]])
    values = jnp.array([1.0, 2.0, 50.0, 3.0, 4.0, 8.0, 60.0])
    logits = jnp.zeros((7, 2))
    valid = jnp.array([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    batch = impala.Batch(
        obs=jnp.zeros((1, 7, 1)),
        actions=jnp.zeros((1, 6), jnp.int32),
        logprobs=jnp.where(valid > 0, jnp.log(0.5), jnp.log(1e-6)),
        rewards=rewards,
        terminations=jnp.array([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]),
        truncations=jnp.array([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]),
        valid=valid,
    )
    hyperparameters = dict(gamma=0.5, vtrace_lambda=1.0, clip_rho=1.0, clip_pg_rho=1.0)
    targets, advantages = impala.vtrace(
        values=values,
        rewards=rewards[0],
        terminations=batch.terminations[0],
        truncations=batch.truncations[0],
        log_rhos=jnp.zeros(6),
        **hyperparameters,
    )
    np.testing.assert_allclose(targets[valid[0] > 0], [2.0, 2.0, 7.0, 8.0])
    np.testing.assert_allclose(advantages[valid[0] > 0], [1.0, 0.0, 4.0, 4.0])

    grads, metrics = jax.grad(impala.impala_loss, has_aux=True)(
        (logits, values),
        apply_fn=lambda params, obs: params,
        batch=batch,
        count=4.0,
        ent_coef=0.01,
        vf_coef=0.5,
        **hyperparameters,
    )
    np.testing.assert_allclose(metrics["baseline_loss"], 0.5 * (1 + 0 + 16 + 16) / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["pg_loss"], (1 + 0 + 4 + 4) / 4 * np.log(2), rtol=1e-6)
    np.testing.assert_allclose(metrics["entropy"], np.log(2), rtol=1e-6)
    np.testing.assert_allclose(metrics["approx_kl"], 0.0, atol=1e-7)
    # Reset steps and the final observation have zero weight: no gradient reaches their outputs.
    logits_grad, values_grad = map(np.asarray, grads)
    for index in (2, 5, 6):
        assert not np.any(logits_grad[index]) and values_grad[index] == 0, index
    np.testing.assert_allclose(
        values_grad[[0, 1, 3, 4]], -0.5 * np.array([1.0, 0.0, 4.0, 4.0]) / 4, rtol=1e-6
    )


def test_minibatch_membership_depends_on_global_env_index_only():
    key = jax.random.PRNGKey(3)
    together = minibatch_ids(key, jnp.arange(16), 4)
    halves = [minibatch_ids(key, jnp.arange(8) + k, 4) for k in (0, 8)]
    np.testing.assert_array_equal(together, np.concatenate(halves))
    # Every block of 4 consecutive envs sends one env to each minibatch, in an order that varies.
    assert all(
        sorted(block) == [0, 1, 2, 3] for block in np.asarray(together).reshape(4, 4).tolist()
    )
    assert len({tuple(block) for block in np.asarray(together).reshape(4, 4).tolist()}) > 1


@pytest.fixture(scope="session")
def sync_run(tmp_path_factory):
    """IMPALA (Sync) on Breakout (the ResNet torso) on the default device, with save and
    evaluation."""
    cwd = tmp_path_factory.mktemp("impala_sync")
    args = [
        *IMPALA_TINY,
        "--local-num-envs",
        4,
        "--num-actor-threads",
        2,
        "--total-timesteps",
        512,
        "--no-concurrency",
        "--save-model",
        "--eval-episodes",
        2,
        "--run-name",
        "sync",
    ]
    result = run_script("cleanba_impala.py", args, cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, cwd / "runs" / "sync"


def test_sync_run_has_lag_zero_and_summary(sync_run):
    result, run_dir = sync_run
    assert_policy_lag(run_dir, concurrent=False, num_updates=4)
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["args"]["concurrency"] is False and spec["args"]["clip_rho_threshold"] == 1.0
    assert spec["sizes"] == {
        "num_envs": 8,
        "steps_per_update": 128,
        "num_updates": 4,
    }
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (
        result.stdout.strip().splitlines()[-1].startswith("params_fingerprint=")
        and summary["learner_policy_version"] == 4
    )


def test_save_load_evaluate_round_trip(sync_run):
    _, run_dir = sync_run
    evaluation = evaluate_saved_model(run_dir / "cleanba_impala.cleanba_model")
    assert evaluation["env_id"] == "Breakout-v5" and len(evaluation["returns"]) == 2
    assert sorted(evaluation["returns"]) == sorted(
        v for _, v in scalars(run_dir, "eval/episodic_return")
    )


MINATAR_TINY = [
    *["--env-id", "gymnax:Breakout-MinAtar", "--channels", 4, "--hiddens", 16],
    *["--local-num-envs", 4, "--num-actor-threads", 1, "--num-steps", 8],
    *["--num-minibatches", 2, "--total-timesteps", 96, "--log-frequency", 1000],
]


def test_minatar_in_the_compiled_rollout_repeats_its_fingerprint(tmp_path):
    """A JAX environment's actor plays in one compiled program and its small float images go
    through Young & Tian's MinAtar torso (one 3x3 convolution of --channels 4); the same seed gives
    the same run."""
    fingerprints = []
    for name in "ab":
        args = [*MINATAR_TINY, "--save-model", "--run-name", name]
        result = run_script("cleanba_impala.py", args, tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        fingerprints.append(fingerprint_of(result))
    assert fingerprints[0] == fingerprints[1]
    params = load_params(tmp_path / "runs" / "a" / "cleanba_impala.cleanba_model")["params"]
    assert params["MinAtarTorso_0"]["Conv_0"]["kernel"].shape == (3, 3, 4, 4)


def test_a_failing_actor_ends_the_process(tmp_path):
    args = [*IMPALA_TINY, "--local-num-envs", 4, "--total-timesteps", 100_000]
    result = run_failing("cleanba_impala", "actor", args, tmp_path)
    assert result.returncode == 1 and "environment exploded" in result.stderr
    assert seconds_after_failure(result, time.time()) < PROMPT_EXIT_SECONDS


BAD_INPUTS = [
    (["--env-id", "Hopper-v4"], "cleanba/cleanba_ppo_continuous.py"),
    (["--local-num-envs", "6", "--num-minibatches", "4"], "--num-minibatches"),
    (["--clip-rho-threshold", "-1"], "--clip-rho-threshold"),
    (["--clip-pg-rho-threshold", "0"], "--clip-pg-rho-threshold"),
    (["--vtrace-lambda", "1.5"], "--vtrace-lambda"),
    (["--update-epochs", "2"], "--update-epochs"),
    (["--num-minibatches", "0"], "--num-minibatches"),
    (
        ["--local-num-envs", "8", "--num-minibatches", "2", "--gradient-accumulation-steps", "3"],
        "--num-minibatches",
    ),
    (["--vf-coef", "nan"], "--vf-coef"),
]


@pytest.mark.parametrize("args,option", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(capsys, args, option):
    assert_refused(impala, args, option, capsys)
