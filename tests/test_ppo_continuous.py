"""cleanba_ppo_continuous.py: the Gaussian policy, the statistics and GAE against hand computations,
then short HalfCheetah runs in subprocesses (2 CPU devices) for clipping, the policy lag,
determinism, layout invariance and resume."""

import json
import math
import os
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PROMPT_EXIT_SECONDS,
    REPO,
    assert_policy_lag,
    assert_refused,
    flatten,
    load_params,
    max_abs_difference,
    run_failing,
    scalars,
    seconds_after_failure,
)
from preempt import assert_resumed_as_uninterrupted

from cleanba import cleanba_ppo_continuous as ppo
from cleanba_utils.experiments.events import read_scalars

MODEL = "cleanba_ppo_continuous.cleanba_model"
# 4 envs x 16 steps per update, 3 updates; HalfCheetah's episodes (1000 steps) never end here, so
# every step counts in the statistics.
TINY = [
    "--env-id",
    "HalfCheetah-v4",
    "--num-steps",
    16,
    "--num-minibatches",
    2,
    "--update-epochs",
    2,
    "--total-timesteps",
    192,
    "--log-frequency",
    1,
    "--save-model",
]
STEPS = 192
INITIAL_COUNT = 1e-4

# The same run under two layouts differs by float rounding only. Measured after 3 updates: 1 vs 2
# learner devices, parameters at most 3e-8 apart (asserted with 20x margin) and the statistics
# 1e-7 relative (the observations' variance, ~80: 7.6e-6 absolute; asserted as 2e-6 absolute plus
# relative, 20x); 1 vs 2 actor threads, identical.
LAYOUT_ATOL = 6e-7
STATS_TOL = 2e-6


def test_gaussian_log_prob_and_entropy_hand_computed():
    mean = np.array([[0.5, -1.0]])
    log_std = np.array([0.0, math.log(2.0)])
    action = np.array([[1.5, 2.0]])
    # Dimension 0: N(1.5; 0.5, 1); dimension 1: N(2; -1, 2), z = 1.5.
    expected = (
        -0.5 * 1.0**2
        - 0.5 * math.log(2 * math.pi)
        - 0.5 * 1.5**2
        - math.log(2.0)
        - 0.5 * math.log(2 * math.pi)
    )
    log_prob = ppo.gaussian_log_prob(jnp.asarray(mean), jnp.asarray(log_std), jnp.asarray(action))
    np.testing.assert_allclose(log_prob, [expected], rtol=1e-6)
    # A Gaussian's entropy is 0.5 log(2 pi e sigma^2) per dimension.
    expected_entropy = 0.5 * math.log(2 * math.pi * math.e) + 0.5 * math.log(
        2 * math.pi * math.e * 4.0
    )
    np.testing.assert_allclose(ppo.gaussian_entropy(jnp.asarray(log_std)), expected_entropy)


def test_combined_statistics_are_those_of_the_union():
    rng = np.random.default_rng(0)
    first = rng.normal(3.0, 2.0, size=(50, 3))
    second = rng.normal(-1.0, 0.5, size=(70, 3))
    stats = ppo.combined(
        ppo.MeanVar(first.mean(0), first.var(0), 50.0),
        ppo.MeanVar(second.mean(0), second.var(0), 70.0),
    )
    union = np.concatenate([first, second])
    np.testing.assert_allclose(stats.mean, union.mean(0), rtol=1e-10)
    np.testing.assert_allclose(stats.var, union.var(0), rtol=1e-10)
    assert stats.count == 120.0


def test_gae_truncation_bootstraps_from_the_last_observation_hand_computed():
    # Step 1 truncates the episode; envpool's step 2 is the reset step, whose observation is the
    # episode's last one (value 4) and whose reward is 0. gamma 0.5, lambda 0.5:
    # A3 = 3 + 0.5 * 8 - 2 = 5; A2 (reset step, masked in the loss) = 0 + 0.5 * 2 - 4 + 0.25 * 5 =
    # -1.75; A1 = 2 + 0.5 * 4 - 1 = 3 (the trace is cut); A0 = 1 + 0.5 * 1 - 0.5 + 0.25 * 3 = 1.75.
    rewards = jnp.array([1.0, 2.0, 0.0, 3.0])
    values = jnp.array([0.5, 1.0, 4.0, 2.0, 8.0])
    no_end = jnp.zeros(4)
    truncated = jnp.array([0.0, 1.0, 0.0, 0.0])
    advantages, returns = ppo.gae(rewards, values, no_end, truncated, gamma=0.5, gae_lambda=0.5)
    np.testing.assert_allclose(advantages, [1.75, 3.0, -1.75, 5.0])
    np.testing.assert_allclose(returns, [2.25, 4.0, 2.25, 7.0])
    # Terminated instead: no bootstrap, A1 = 2 - 1.
    advantages, _ = ppo.gae(rewards, values, truncated, no_end, gamma=0.5, gae_lambda=0.5)
    np.testing.assert_allclose(advantages, [1.25, 1.0, -1.75, 5.0])


def test_without_bootstrapped_truncations_a_time_limit_is_a_termination_hand_computed():
    # CleanRL's treatment: step 1's truncation stops the bootstrap as a termination would, A1 = 2 -
    # 1 = 1, and A0 = 1 + 0.5 * 1 - 0.5 + 0.25 * 1 = 1.25 (the default bootstraps: A1 = 3, above).
    rewards = jnp.array([1.0, 2.0, 0.0, 3.0])
    values = jnp.array([0.5, 1.0, 4.0, 2.0, 8.0])
    no_end = jnp.zeros(4, bool)
    truncated = jnp.array([False, True, False, False])
    for bootstrap, expected in [(True, [1.75, 3.0]), (False, [1.25, 1.0])]:
        terminations = ppo.treated_as_terminations(no_end, truncated, bootstrap)
        advantages, _ = ppo.gae(
            rewards,
            values,
            terminations.astype(jnp.float32),
            truncated.astype(jnp.float32),
            gamma=0.5,
            gae_lambda=0.5,
        )
        np.testing.assert_allclose(advantages[:2], expected)


# Runs the script's main once per command, in one process (an import of JAX and envpool takes ~8 s
# of CPU here), recording what the actors' environments receive and what the actors store. A command
# may first copy another run's checkpoints up to an update, to resume from there.
DRIVER = """
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np

import cleanba.cleanba_ppo_continuous as script

sys.path.insert(0, sys.argv[2])
from preempt import run_command  # noqa: E402

make_env, queue_put = script.make_env, script.queue_put
sent, stored = [], []


class RecordingEnv:
    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    def xla(self):
        # What the compiled rollout hands envpool at every step (a resumed actor's fast-forward
        # steps some environments alone through `step`: not recorded).
        handle, recv, send, step = self.env.xla()

        def recording_step(handle, action, env_ids):
            record = lambda sent_action: sent.append(np.array(sent_action))
            jax.debug.callback(record, action, ordered=True)
            return step(handle, action, env_ids)

        return handle, recv, send, recording_step


def recording_queue_put(q, item, stop):
    if isinstance(item, script.Rollout):
        stored.append(np.asarray(item.data.actions)[0])
    return queue_put(q, item, stop)


script.make_env = lambda *args: RecordingEnv(make_env(*args))
script.queue_put = recording_queue_put
for command in json.loads(sys.argv[1]):
    run_dir = Path("runs") / command["name"]
    if command.get("resume_from"):
        source, update = command["resume_from"]
        shutil.copytree(Path("runs") / source / "checkpoints", run_dir / "checkpoints")
        for checkpoint in (run_dir / "checkpoints").glob("*.ckpt"):
            if int(checkpoint.stem.split("_")[1]) > update:
                checkpoint.unlink()
    sent.clear()
    stored.clear()
    run_command(script, command)
    if sent:
        np.savez(run_dir / "actions.npz", sent=np.stack(sent), stored=np.stack(stored))
"""

CONCURRENT = ["--local-num-envs", 4, "--concurrency", "--checkpoint-every", 2]
# Hopper's episodes end within a few dozen steps: a resumed run's environments are reset and their
# discounted returns restarted as the uninterrupted run's were.
HOPPER = ["--env-id", "Hopper-v4", "--local-num-envs", 4, "--concurrency"]
# Evaluations of the untrained policy at step 0, after update 2 and after the last (3).
EVALUATED = ["--eval-episodes", 1, "--eval-every", 2]
# Two processes: the same command in both (determinism across processes), the layouts, the
# resumption of run "one" from its last checkpoint, runs preempted by SIGTERM and resumed, and a
# sync run.
PROCESSES = [
    [
        dict(name="one", argv=CONCURRENT),
        dict(
            name="two_threads", argv=[*CONCURRENT, "--local-num-envs", 2, "--num-actor-threads", 2]
        ),
        dict(name="resumed_at_end", argv=[*CONCURRENT, "--resume"], resume_from=["one", 3]),
        dict(name="resumed", argv=["--local-num-envs", 4, "--concurrency"], preempted_after=2),
        dict(name="hopper", argv=HOPPER),
    ],
    [
        dict(name="one_again", argv=CONCURRENT),
        dict(name="two_learners", argv=[*CONCURRENT, "--learner-device-ids", 0, 1]),
        dict(name="sync", argv=["--local-num-envs", 4, *EVALUATED]),
        dict(name="sync_preempted", argv=["--local-num-envs", 4, *EVALUATED], preempted_after=1),
        dict(name="hopper_preempted", argv=HOPPER, preempted_after=2),
    ],
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directory and stdout of each run; both processes see 2 CPU devices."""
    cwd = tmp_path_factory.mktemp("ppo_continuous")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    processes = []
    for commands in PROCESSES:
        commands = [dict(c, argv=[*map(str, TINY), *map(str, c["argv"])]) for c in commands]
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", DRIVER, json.dumps(commands), str(REPO / "tests")],
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


def fingerprint(run_dir) -> str:
    return json.loads((run_dir / "summary.json").read_text())["params_fingerprint"]


def test_actions_are_stored_unclipped_and_clipped_only_at_the_environment(runs):
    run_dir = runs[0] / "sync"
    actions = np.load(run_dir / "actions.npz")
    # stored: (updates, envs, steps, action dims); sent: (updates x steps, envs, action dims).
    stored = actions["stored"].transpose(0, 2, 1, 3).reshape(actions["sent"].shape)
    assert (np.abs(stored) > 1).mean() > 0.1  # log std 0: a third of the draws leave [-1, 1]
    np.testing.assert_array_equal(actions["sent"], np.clip(stored, -1.0, 1.0))


def test_the_model_file_plays_as_the_run_evaluated_it(runs):
    # The parameters and the frozen statistics, read back from the file: the same episode.
    run_dir = runs[0] / "sync"
    args = ppo.parse_args([*map(str, TINY), "--local-num-envs", "4"])
    returns = ppo.evaluate(load_params(run_dir / MODEL), args, 1, args.seed + 1_000_000)
    np.testing.assert_allclose(returns, [v for _, v in scalars(run_dir, "eval/episodic_return")])


def test_a_resumed_run_keeps_the_evaluation_of_step_0_and_does_not_make_it_again(runs):
    # Preempted during update 1, resumed from its checkpoint: two sessions, two event files.
    run_dir = runs[0] / "sync_preempted"
    sessions = list(run_dir.glob("events.out.tfevents.*"))
    assert len(sessions) == 2
    evaluated = [step for path in sessions for step, _ in scalars(path, "charts/eval_return")]
    assert sorted(evaluated) == [0, 128, 192]
    assert read_scalars(run_dir, "charts/eval_return").steps.tolist() == [0, 128, 192]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [step for step, _ in summary["eval_returns"]] == [0, 128, 192]


def test_sync_run_has_lag_zero(runs):
    assert_policy_lag(runs[0] / "sync", concurrent=False, num_updates=3)


def test_concurrent_run_has_lag_one_after_the_first_update(runs):
    assert_policy_lag(runs[0] / "one", concurrent=True, num_updates=3)


def test_same_command_twice_gives_the_same_fingerprint(runs):
    assert fingerprint(runs[0] / "one") == fingerprint(runs[0] / "one_again")


@pytest.mark.parametrize("layout", ["two_learners", "two_threads"])
def test_layout_changes_parameters_and_statistics_by_rounding_only(runs, layout):
    reference = load_params(runs[0] / "one" / MODEL)
    other = load_params(runs[0] / layout / MODEL)
    assert max_abs_difference(reference["params"], other["params"]) < LAYOUT_ATOL
    for statistic, stats in flatten(reference["normalizer"]).items():
        np.testing.assert_allclose(
            flatten(other["normalizer"])[statistic], stats, rtol=STATS_TOL, atol=STATS_TOL
        )
    # Every step of every environment counted once, whatever the layout.
    for saved in (reference, other):
        for stats in saved["normalizer"].values():
            np.testing.assert_allclose(stats["count"], INITIAL_COUNT + STEPS, rtol=1e-6)


def test_resume_from_the_last_checkpoint_restores_parameters_and_statistics(runs):
    run_dirs, stdout = runs
    assert "resuming resumed_at_end from update 3" in stdout
    # Nothing left to train: the fingerprint covers the parameters and the statistics.
    assert fingerprint(run_dirs / "resumed_at_end") == fingerprint(run_dirs / "one")


def test_resume_continues_the_statistics(runs):
    run_dirs, stdout = runs
    assert "resuming resumed from update 2" in stdout
    # The checkpoint's 128 steps and the resumed update's 64: counted on from the checkpoint's
    # statistics, not from fresh ones.
    for stats in load_params(run_dirs / "resumed" / MODEL)["normalizer"].values():
        np.testing.assert_allclose(stats["count"], INITIAL_COUNT + STEPS, rtol=1e-6)


@pytest.mark.parametrize(
    "name,source,update",
    [("resumed", "one", 2), ("sync_preempted", "sync", 1), ("hopper_preempted", "hopper", 2)],
)
def test_a_preempted_and_resumed_run_repeats_the_uninterrupted_one(runs, name, source, update):
    # SIGTERM during update k: the checkpoint of update k holds the learner with its statistics,
    # the policy the actors play their next rollout with, and what each environment did since its
    # last reset (its discounted return is replayed with it): the resumed run gives the same
    # parameters and statistics, bit for bit.
    assert_resumed_as_uninterrupted(*runs, name=name, source=source, update=update)


# Each refused with exit 2 and one line naming the option (or the script to use instead).
BAD_INPUTS = [
    (["--env-id", "NoSuchTask-v4"], "--env-id"),
    (["--env-id", "Breakout-v5"], "cleanba_ppo.py"),
    (["--env-id", "CartPole-v1"], "cleanba_ppo.py"),
    (["--total-timesteps", "0"], "--total-timesteps"),
    (["--total-timesteps", "100"], "--total-timesteps"),
    (["--clip-coef", "inf"], "--clip-coef"),
    (["--learning-rate", "nan"], "--learning-rate"),
    (["--gamma", "1.5"], "--gamma"),
    (["--hiddens", "0"], "--hiddens"),
    (["--num-steps", "100", "--num-minibatches", "32"], "--num-steps"),
    (["--eval-every", "5"], "--eval-every"),
    (["--learner-device-ids", "7"], "--learner-device-ids"),
    (["--resume"], "--resume"),
]


@pytest.mark.parametrize("args,option", BAD_INPUTS)
def test_bad_input_is_refused_with_one_line(capsys, args, option):
    assert_refused(ppo, args, option, capsys)


def test_a_crashing_actor_ends_the_process(tmp_path):
    # The 20th environment step of the compiled rollout fails (a callback from inside it).
    args = [*TINY[: TINY.index("--total-timesteps")], "--total-timesteps", 1_000_000]
    result = run_failing("cleanba_ppo_continuous", "actor", args, tmp_path)
    assert result.returncode == 1 and "environment exploded" in result.stderr, result.stderr[-3000:]
    assert seconds_after_failure(result, time.time()) < PROMPT_EXIT_SECONDS
