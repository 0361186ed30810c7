"""Both scripts, the same global config (8 envs, 3 concurrent updates) under several layouts on 4
CPU devices: the policy lag of every update, determinism, layout invariance, and what is logged."""

import json

import numpy as np
import pytest
from helpers import (
    IMPALA_LAYOUT_ATOL,
    IMPALA_TINY,
    PPO_LAYOUT_ATOL,
    TINY,
    assert_policy_lag,
    fingerprint_of,
    load_params,
    max_abs_difference,
    run_script,
    scalar_tags,
    scalars,
)

# helpers puts benchmark/ on the import path.
from fingerprints import command_of  # isort: skip

SHARED_TAGS = {
    "charts/SPS",
    "charts/learning_rate",
    "losses/entropy",
    "losses/approx_kl",
    "stats/actor_policy_version",
    "stats/learner_policy_version",
    "stats/rollout_queue_get_time",
    "stats/param_queue_get_time",
    "stats/rollout_time",
    "stats/learn_time",
    "stats/env_step_time",
    "stats/inference_time",
}
SCRIPTS = {
    "cleanba_ppo": dict(
        args=[*TINY, "--concurrency"],
        atol=PPO_LAYOUT_ATOL,
        tags={"losses/policy_loss", "losses/value_loss", "losses/clipfrac"},
        learning_rates=[2.5e-4, 2.5e-4 * 2 / 3, 2.5e-4 / 3],
    ),
    # CartPole: episodes of a few dozen steps, so every layout crosses episode boundaries (its
    # vector observations take no --channels).
    "cleanba_impala": dict(
        args=[*IMPALA_TINY[IMPALA_TINY.index("--hiddens") :], "--env-id", "CartPole-v1"],
        atol=IMPALA_LAYOUT_ATOL,
        tags={"losses/pg_loss", "losses/baseline_loss", "charts/episodic_return"},
        learning_rates=[6e-4, 4e-4, 2e-4],
    ),
}
LAYOUTS = {
    "one_learner": ["--local-num-envs", 8, "--num-actor-threads", 1, "--learner-device-ids", 1],
    "one_learner_again": [
        "--local-num-envs",
        8,
        "--num-actor-threads",
        1,
        "--learner-device-ids",
        1,
    ],
    "two_learners": ["--local-num-envs", 8, "--num-actor-threads", 1, "--learner-device-ids", 1, 2],
    "two_threads": ["--local-num-envs", 4, "--num-actor-threads", 2, "--learner-device-ids", 1],
}


@pytest.fixture(scope="module", params=SCRIPTS)
def layout_runs(request, tmp_path_factory):
    script = request.param
    cwd = tmp_path_factory.mktemp(f"{script}_layouts")
    runs = {}
    for name, layout in LAYOUTS.items():
        args = [
            *SCRIPTS[script]["args"],
            "--total-timesteps",
            384,
            "--save-model",
            "--actor-device-ids",
            0,
            *layout,
            "--run-name",
            name,
        ]
        result = run_script(f"{script}.py", args, cwd, devices=4)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = (result, cwd / "runs" / name)
    return script, runs


def test_concurrent_run_has_lag_one_after_first_update(layout_runs):
    _, runs = layout_runs
    for _, run_dir in runs.values():
        assert_policy_lag(run_dir, concurrent=True, num_updates=3)


def test_same_command_twice_gives_same_fingerprint(layout_runs):
    _, runs = layout_runs
    assert fingerprint_of(runs["one_learner"][0]) == fingerprint_of(runs["one_learner_again"][0])


@pytest.mark.parametrize("layout", ["two_learners", "two_threads"])
def test_layout_does_not_change_parameters(layout_runs, layout):
    script, runs = layout_runs
    reference = load_params(runs["one_learner"][1] / f"{script}.cleanba_model")
    other = load_params(runs[layout][1] / f"{script}.cleanba_model")
    assert max_abs_difference(reference, other) < SCRIPTS[script]["atol"]


def test_four_devices_actor_on_0_learners_on_1_2_log_everything(layout_runs):
    script, runs = layout_runs
    run_dir = runs["two_learners"][1]
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["script"] == f"{script}.py" and spec["args"]["learner_device_ids"] == [1, 2]
    assert len(spec["devices"]) == 4
    assert SHARED_TAGS | SCRIPTS[script]["tags"] <= scalar_tags(run_dir)
    learning_rates = [value for _, value in scalars(run_dir, "charts/learning_rate")]
    np.testing.assert_allclose(learning_rates, SCRIPTS[script]["learning_rates"], rtol=1e-6)


# In the long checks (`-m long`): eight runs of the small configurations, about 2 minutes.
@pytest.mark.long
@pytest.mark.parametrize(
    "script", ["cleanba_ppo", "cleanba_impala", "cleanba_apex_dqn", "cleanba_gala_a2c"]
)
def test_two_env_splits_the_gpu_default_train_as_one(tmp_path, script):
    """--env-splits 2, the default on a GPU, against 1, the CPU's, at the script's small
    configuration of benchmark/fingerprints.py: the same environments in two envpool instances, the
    same computation. IMPALA, Ape-X DQN and GALA-A2C give the same fingerprint; PPO's parameters
    differ by float rounding (its values of each half of the batch are computed apart, which rounds
    their last bit otherwise) within PPO_LAYOUT_ATOL."""
    command = command_of(script)
    params = {}
    fingerprints = {}
    for splits in (1, 2):
        name = f"splits{splits}"
        argv = [*command[1:], "--env-splits", str(splits), "--save-model", "--run-name", name]
        result = run_script(f"{script}.py", argv, tmp_path, devices=4)
        assert result.returncode == 0, result.stderr[-3000:]
        fingerprints[splits] = fingerprint_of(result)
        params[splits] = load_params(tmp_path / "runs" / name / f"{script}.cleanba_model")
    if script == "cleanba_ppo":
        assert max_abs_difference(params[1], params[2]) <= PPO_LAYOUT_ATOL
    else:
        assert fingerprints[1] == fingerprints[2]
