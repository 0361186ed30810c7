"""cleanba_ppo.py: numerics against hand-written references, then real short runs in
subprocesses."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PROMPT_EXIT_SECONDS,
    REPO,
    TINY,
    assert_policy_lag,
    assert_refused,
    evaluate_saved_model,
    fingerprint_of,
    run_failing,
    run_script,
    scalars,
    seconds_after_failure,
    wait_for_line,
)

from cleanba import cleanba_ppo as ppo


def python_gae(rewards, values, terminations, truncations, gamma, lam):
    """The GAE recursion written out step by step, one environment."""
    num_steps = len(rewards)
    advantages = [0.0] * num_steps
    next_advantage = 0.0
    for t in reversed(range(num_steps)):
        bootstrap = 0.0 if terminations[t] else values[t + 1]
        delta = rewards[t] + gamma * bootstrap - values[t]
        episode_continues = not (terminations[t] or truncations[t])
        next_advantage = delta + gamma * lam * episode_continues * next_advantage
        advantages[t] = next_advantage
    return np.array(advantages), np.array(advantages) + np.array(values[:-1])


def test_gae_matches_python_loop():
    rng = np.random.default_rng(0)
    num_steps = 50
    rewards = rng.normal(size=num_steps).astype(np.float32)
    values = rng.normal(size=num_steps + 1).astype(np.float32)
    terminations = rng.random(num_steps) < 0.1
    truncations = (rng.random(num_steps) < 0.1) & ~terminations
    advantages, returns = ppo.gae(
        jnp.asarray(rewards),
        jnp.asarray(values),
        jnp.asarray(terminations, jnp.float32),
        jnp.asarray(truncations, jnp.float32),
        gamma=0.99,
        gae_lambda=0.95,
    )
    expected_advantages, expected_returns = python_gae(
        rewards=rewards,
        values=values,
        terminations=terminations,
        truncations=truncations,
        gamma=0.99,
        lam=0.95,
    )
    np.testing.assert_allclose(advantages, expected_advantages, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returns, expected_returns, rtol=1e-5, atol=1e-5)


def test_gae_hand_computed_truncation_bootstraps_and_termination_does_not():
    # step 0 truncated: A0 = 1 + 0.5 * V1 - V0 (no trace from step 1); step 1 terminated: A1 = 2 -
    # V1.
    advantages, _ = ppo.gae(
        jnp.array([1.0, 2.0]),
        jnp.array([0.5, 4.0, 8.0]),
        jnp.array([0.0, 1.0]),
        jnp.array([1.0, 0.0]),
        gamma=0.5,
        gae_lambda=1.0,
    )
    np.testing.assert_allclose(advantages, [1 + 0.5 * 4.0 - 0.5, 2.0 - 4.0])


def test_ppo_loss_hand_computed():
    # Both valid samples see uniform logits over 2 actions: logprob = log 0.5.
    # Sample 0: old prob 0.25 -> ratio 2, advantage +1: max(-2, -1.1) = -1.1.
    # Sample 1: old prob 1 -> ratio 0.5, advantage -1: max(0.5, 0.9) = 0.9.
    # Sample 2 is a reset step (valid = 0) with extreme numbers that must not count.
    logits = jnp.array([[0.0, 0.0], [0.0, 0.0], [50.0, -50.0]])
    values = jnp.array([1.0, 0.0, 100.0])
    batch = ppo.Batch(
        obs=jnp.zeros((1, 3, 1)),
        actions=jnp.array([[0, 1, 1]]),
        logprobs=jnp.log(jnp.array([[0.25, 1.0, 1e-6]])),
        values=jnp.zeros((1, 3)),
        returns=jnp.array([[3.0, 0.0, -100.0]]),
        advantages=jnp.array([[1.0, -1.0, 1e6]]),
        valid=jnp.array([[1.0, 1.0, 0.0]]),
    )
    loss, metrics = ppo.ppo_loss(
        None,
        apply_fn=lambda params, obs: (logits, values),
        batch=batch,
        count=2.0,
        clip_coef=0.1,
        ent_coef=0.01,
        vf_coef=0.5,
        clip_vloss=False,
    )
    np.testing.assert_allclose(metrics["policy_loss"], (-1.1 + 0.9) / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["value_loss"], (0.5 * 2.0**2 + 0.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["entropy"], np.log(2), rtol=1e-6)
    np.testing.assert_allclose(
        metrics["approx_kl"], ((1 - np.log(2)) + (-0.5 + np.log(2))) / 2, rtol=1e-5
    )
    np.testing.assert_allclose(metrics["clipfrac"], 1.0)
    np.testing.assert_allclose(loss, -0.1 - 0.01 * np.log(2) + 0.5 * 1.0, rtol=1e-5)


def test_clipped_value_loss_hand_computed():
    # New value V (the parameters here), rollout value V_old, return R, clip 0.2; per-sample loss is
    # max((V - R)^2, (V_old + clip(V - V_old, -0.2, 0.2) - R)^2): Sample 0: V 1, V_old 0.5, R 3:
    # max((1 - 3)^2, (0.7 - 3)^2) = max(4, 5.29) = 5.29, clip saturated: no gradient. Sample 1: V 0,
    # V_old 0.5, R 0: max(0, (0.3 - 0)^2) = 0.09, clip saturated: no gradient. Sample 2: V 1, V_old
    # 0, R -1: max((1 + 1)^2, (0.2 + 1)^2) = max(4, 1.44) = 4, gradient of
    # vf_coef * 0.5 * (V - R)^2 / count = 0.5 * (1 + 1) / 3 = 1/3. Sample 3 is a reset step (valid =
    # 0). value_loss = 0.5 * (5.29 + 0.09 + 4) / 3 = 1.563333...
    values = jnp.array([1.0, 0.0, 1.0, 50.0])
    batch = ppo.Batch(
        obs=jnp.zeros((1, 4, 1)),
        actions=jnp.zeros((1, 4), jnp.int32),
        logprobs=jnp.log(jnp.full((1, 4), 0.5)),
        values=jnp.array([[0.5, 0.5, 0.0, 0.0]]),
        returns=jnp.array([[3.0, 0.0, -1.0, -50.0]]),
        advantages=jnp.zeros((1, 4)),
        valid=jnp.array([[1.0, 1.0, 1.0, 0.0]]),
    )

    def loss(values, clip_vloss):
        return ppo.ppo_loss(
            values,
            apply_fn=lambda params, obs: (jnp.zeros((4, 2)), params),
            batch=batch,
            count=3.0,
            clip_coef=0.2,
            ent_coef=0.0,
            vf_coef=0.5,
            clip_vloss=clip_vloss,
        )

    (_, metrics), grads = ppo.jax.value_and_grad(loss, has_aux=True)(values, True)
    np.testing.assert_allclose(metrics["value_loss"], 0.5 * (5.29 + 0.09 + 4.0) / 3, rtol=1e-6)
    np.testing.assert_allclose(grads, [0.0, 0.0, 1 / 3, 0.0], atol=1e-7)
    # Unclipped: 0.5 * (4 + 0 + 4) / 3.
    np.testing.assert_allclose(loss(values, False)[1]["value_loss"], 0.5 * 8.0 / 3, rtol=1e-6)


def test_action_sampling_depends_on_env_index_not_batch():
    logits = jnp.zeros((6, 18))
    together = ppo.sample_actions(logits, ppo.jax.random.PRNGKey(0), 7, jnp.arange(6))
    halves = [
        ppo.sample_actions(logits[:3], ppo.jax.random.PRNGKey(0), 7, jnp.arange(3) + k)
        for k in (0, 3)
    ]
    np.testing.assert_array_equal(together, np.concatenate(halves))
    assert len(set(np.asarray(together).tolist())) > 1


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Breakout-v5"])
def test_envpool_send_then_recv_is_step_in_env_id_order(env_id):
    """The actors hand envpool the actions (`send`) and take the step's results later (`recv`): in
    envpool's synchronous mode, as `make_env` makes the environments, `recv` returns every
    environment in env-id order, the arrays `step` returns, episode ends included (CartPole's)."""
    args = ppo.parse_args(
        ["--env-id", env_id, "--local-num-envs", "8", "--envpool-num-threads", "3"]
    )
    stepped, sent = ppo.make_env(args, 5, 8), ppo.make_env(args, 5, 8)
    np.testing.assert_array_equal(stepped.reset()[0], sent.reset()[0])
    actions = np.random.default_rng(0).integers(0, stepped.action_space.n, (60, 8))
    ends = 0
    for action in actions:
        expected = stepped.step(action)
        sent.send(action)
        received = sent.recv()
        np.testing.assert_array_equal(received[4]["env_id"], np.arange(8))
        for got, want in zip(received[:4], expected[:4], strict=True):
            np.testing.assert_array_equal(got, want)
        ends += int((received[2] | received[3]).sum())
    if env_id == "CartPole-v1":
        assert ends > 0


@pytest.fixture(scope="session")
def sync_run(tmp_path_factory):
    """Sync mode on the default device, with save, evaluation and an offline W&B run."""
    cwd = tmp_path_factory.mktemp("sync")
    args = [
        *TINY,
        "--local-num-envs",
        4,
        "--num-actor-threads",
        2,
        "--total-timesteps",
        512,
        "--save-model",
        "--eval-episodes",
        2,
        "--track",
        "--run-name",
        "sync",
    ]
    result = run_script(
        "cleanba_ppo.py", args, cwd, extra_env={"WANDB_MODE": "offline", "WANDB_DIR": str(cwd)}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, cwd / "runs" / "sync", cwd


def test_sync_run_has_lag_zero(sync_run):
    assert_policy_lag(sync_run[1], concurrent=False, num_updates=4)


def test_spec_and_summary(sync_run):
    result, run_dir, _ = sync_run
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["args"]["total_timesteps"] == 512 and spec["args"]["concurrency"] is False
    assert spec["sizes"] == {
        "num_envs": 8,
        "steps_per_update": 128,
        "num_updates": 4,
    }
    assert {"jax", "flax", "optax", "envpool", "numpy"} <= spec[
        "versions"
    ].keys() and "git_sha" in spec
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["params_fingerprint"]) == 64 and fingerprint_of(result)
    assert summary["global_step"] == 512 and summary["learner_policy_version"] == 4
    assert summary["sps"] > 0 and summary["wall_time_s"] > 0


def test_save_load_evaluate_round_trip(sync_run):
    _, run_dir, _ = sync_run
    assert len(scalars(run_dir, "eval/episodic_return")) == 2
    evaluation = evaluate_saved_model(run_dir / "cleanba_ppo.cleanba_model")
    assert evaluation["env_id"] == "Breakout-v5" and len(evaluation["returns"]) == 2
    # Same model, same default seed: the script's own evaluation and the loaded model's agree.
    assert sorted(evaluation["returns"]) == sorted(
        v for _, v in scalars(run_dir, "eval/episodic_return")
    )


def test_wandb_offline_run_is_written(sync_run):
    _, _, cwd = sync_run
    offline_runs = list((cwd / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and list(offline_runs[0].glob("*.wandb"))


@pytest.mark.parametrize(
    "failure,message", [("actor", "environment exploded"), ("learner", "learner exploded")]
)
def test_a_failing_thread_ends_the_process(tmp_path, failure, message):
    args = [*TINY, "--local-num-envs", 4, "--total-timesteps", 100_000, "--concurrency"]
    result = run_failing("cleanba_ppo", failure, args, tmp_path)
    assert result.returncode == 1 and message in result.stderr
    assert seconds_after_failure(result, time.time()) < PROMPT_EXIT_SECONDS


def test_out_of_device_memory_is_one_line_naming_the_options_and_exit_2(tmp_path):
    args = [*TINY, "--local-num-envs", 4, "--total-timesteps", 640]
    result = run_failing("cleanba_ppo", "oom", args, tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the device ran out of memory"), lines
    assert all(
        option in lines[0]
        for option in ["--local-num-envs", "--num-minibatches", "--gradient-accumulation"]
    )


def test_an_actor_that_skips_a_parameter_fetch_trips_the_lag_check(tmp_path):
    # Sync mode expects lag 0; the actor's second rollout comes from policy 0 while the learner is
    # at 1.
    args = [*TINY, "--local-num-envs", 4, "--num-actor-threads", 1, "--total-timesteps", 640]
    result = run_failing("cleanba_ppo", "lag", args, tmp_path)
    assert result.returncode == 1
    assert (
        "update 2: rollout 2 from policy 0 while the learner is at 1 (lag 1, expected 0)"
        in result.stderr
    )


# Started with SIGINT ignored (kept across exec), as a shell script's background job or a test
# runner's worker starts it.
IGNORING_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def started_ignoring_sigint(args: list, cwd, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            IGNORING_SIGINT,
            sys.executable,
            str(REPO / "cleanba" / "cleanba_ppo.py"),
            *map(str, args),
        ],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_ctrl_c_exits_cleanly_with_logs_flushed(tmp_path):
    args = [*TINY, "--local-num-envs", 4, "--total-timesteps", 100_000, "--run-name", "interrupted"]
    proc = started_ignoring_sigint(args, tmp_path)
    wait_for_line(proc, "update 1/")
    proc.send_signal(signal.SIGINT)
    # 1-2 s from the signal to the exit, alone or beside two busy processes.
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr
    assert scalars(tmp_path / "runs" / "interrupted", "stats/learner_policy_version")


# One update of 400 epochs x 2 minibatches of the tiny network: about 2.5 minutes on 2 CPU cores
# (200 epochs: 70 s), 16,000 optimizer steps in the Python loop that XLA's CPU backend needs.
LONG_UPDATE = [*TINY, "--update-epochs", 400, "--local-num-envs", 8, "--total-timesteps", 256]


@pytest.mark.parametrize(
    "signals_sent,exit_code,message",
    [
        # A terminal's Ctrl-C under `uv run`: the terminal's SIGINT, then uv's, 0.2 s apart.
        ([signal.SIGINT, signal.SIGINT], 130, "interrupted: stopped; no checkpoint was saved"),
        ([signal.SIGUSR1], 138, "stopped by a signal; no checkpoint was saved"),
    ],
)
def test_a_stop_in_the_middle_of_a_long_update_takes_seconds(
    tmp_path, signals_sent, exit_code, message
):
    # The learner's main thread is in the update's loop or waits for XLA: the watcher thread stops
    # the run, abandoning the update (no update has completed, so there is nothing to save). Before,
    # the run says what it will do and, every 2 s here (60 s by default), that it is at work.
    env = dict(os.environ, CLEANBA_PROGRESS_SECONDS="2")
    proc = started_ignoring_sigint([*LONG_UPDATE, "--run-name", "long"], tmp_path, env)
    first_line = proc.stdout.readline()
    assert first_line.startswith("long: 1 update of 256 environment steps (16 environments)")
    assert wait_for_line(proc, "in progress: update 1/1 step=0 SPS=0 ").endswith(
        "ETA=unknown until an update has ended\n"
    )
    sent_at = time.time()
    for signum in signals_sent:
        proc.send_signal(signum)
        time.sleep(0.2)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == exit_code and time.time() - sent_at < 30, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == message and "Traceback" not in stderr


# In the long checks (`-m long`): two runs of about 15 s each.
@pytest.mark.long
@pytest.mark.parametrize(
    "signum,exit_code", [(signal.SIGINT, 130), (signal.SIGUSR1, 138)], ids=["ctrl-c", "usr1"]
)
def test_a_stop_is_acted_on_when_the_console_is_a_pipe_whose_reader_has_gone(
    tmp_path, signum, exit_code
):
    # `python ... | tee train.log` with the tee killed during an update: every print then fails.
    # Before, the stop printed its line, the print raised, and the stop was lost until SIGKILL.
    proc = started_ignoring_sigint([*LONG_UPDATE, "--run-name", "long"], tmp_path)
    assert proc.stdout.readline().startswith("long: 1 update of 256 environment steps")
    proc.stdout.close()
    proc.stderr.close()
    time.sleep(2)
    sent_at = time.time()
    proc.send_signal(signum)
    try:
        # SLURM's KillWait is 30 s; SIGUSR1 waits STOP_GRACE_SECONDS for the update first.
        assert proc.wait(timeout=30) == exit_code
    finally:
        proc.kill()
    assert time.time() - sent_at < 20


# Through a real process (2 CPU devices): exit code, one line, no traceback, nothing written,
# quickly.
PROCESS_BAD_INPUTS = [
    (["--env-id", "NoSuchGame-v5"], "--env-id"),
    (["--learner-device-ids", "0", "1", "--local-num-envs", "3"], "--local-num-envs"),
    (["--num-steps", "abc"], "--num-steps"),
    (["--no-such-option", "1"], "--no-such-option"),
    (["--total-timesteps", "100"], "--total-timesteps"),
]
# The rest of the table in this process, which sees one device.
BAD_INPUTS = [
    (["--env-id", "HalfCheetah-v4"], "cleanba/cleanba_ppo_continuous.py"),
    (["--total-timesteps", "0"], "--total-timesteps"),
    (["--learning-rate", "-1"], "--learning-rate"),
    (["--gamma", "1.5"], "--gamma"),
    (["--gae-lambda", "-0.1"], "--gae-lambda"),
    (["--learner-device-ids", "7"], "--learner-device-ids"),
    (["--actor-device-ids", "0", "0"], "--actor-device-ids"),
    (["--num-steps", "10", "--num-minibatches", "4"], "--num-steps"),
    (["--channels", "0"], "--channels"),
    (["--envpool-num-threads", "0"], "--envpool-num-threads"),
    (["--env-splits", "0"], "--env-splits"),
    (["--local-num-envs", "2", "--env-splits", "3"], "--env-splits"),
    (["--ent-coef", "-0.5"], "--ent-coef"),
    (["--learning-rate", "nan"], "--learning-rate"),
    (["--clip-coef", "inf"], "--clip-coef"),
    (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps"),
    (
        ["--num-steps", "16", "--num-minibatches", "4", "--gradient-accumulation-steps", "3"],
        "--num-steps",
    ),
    (["--resume"], "--resume"),
    (["--process-id", "1"], "--process-id"),
]


@pytest.mark.parametrize("args,option", PROCESS_BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, option):
    # A hang (the run going on to train) ends in TimeoutExpired; the bound leaves a slow machine
    # its start-up.
    result = run_script("cleanba_ppo.py", args, tmp_path, devices=2, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args,option", BAD_INPUTS)
def test_bad_input_is_refused_with_one_line(capsys, args, option):
    assert_refused(ppo, args, option, capsys)


# In the long checks (`-m long`): one run of about 15 s.
@pytest.mark.long
def test_a_cpu_run_that_would_take_days_says_so_within_its_first_update(tmp_path):
    # Of the tiny network's first update, 2 epochs x 2 minibatches x 2 microbatches, the second
    # step is timed; 10^11 steps make the learner alone take days at any CPU's pace.
    args = [*TINY, "--gradient-accumulation-steps", "2", "--total-timesteps", "100000000000"]
    proc = started_ignoring_sigint([*args, "--run-name", "days"], tmp_path)
    # A run that never says so is ended, and the wait below fails.
    deadline = threading.Timer(180, proc.kill)
    deadline.start()
    try:
        before = []
        for line in proc.stdout:
            if line.startswith("note: one learner step took "):
                break
            before.append(line)
    finally:
        deadline.cancel()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    # Said before the first update has ended (the update's own console line).
    assert line.startswith("note: one learner step took "), before[-5:]
    assert not any(earlier.startswith("update 1/") for earlier in before), before
    assert " would take at least " in line and " days in the learner alone" in line
    assert line.rstrip().endswith(
        "a run sized for a CPU: uv run python cleanba/cleanba_ppo.py --env-id Breakout-v5 "
        "--channels 4 8 --hiddens 64 --local-num-envs 8 --num-steps 32 --total-timesteps 100000"
    )
