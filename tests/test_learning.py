"""Both scripts must learn CartPole-v1: a fixed seed and step budget, and a return far above random.

A uniformly random policy averages about 22 on CartPole-v1. With these settings (200k steps, seeds 1-3,
measured 2026-11-21) the last 20 episodes average 86-151 for PPO and 142-201 for IMPALA, so 60 leaves a
margin for float differences between machines, while a learner that stopped learning (or learns from
the wrong data) stays near 22. benchmark/results/learning_cpu.md has the same settings run to 500k."""

import numpy as np
import pytest
from helpers import run_script, scalars

CARTPOLE = [
    "--env-id",
    "CartPole-v1",
    "--hiddens",
    64,
    64,
    "--local-num-envs",
    4,
    "--total-timesteps",
    200_000,
    "--seed",
    1,
    "--log-frequency",
    1000,
    "--run-name",
    "learning",
]
RANDOM_POLICY_RETURN = 22
THRESHOLD = 60


@pytest.mark.parametrize("script", ["cleanba_ppo.py", "cleanba_impala.py"])
def test_script_learns_cartpole(tmp_path, script):
    result = run_script(script, CARTPOLE, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # Sorted by step: the two actor threads log their episodes in either order.
    returns = [value for _, value in sorted(scalars(tmp_path / "runs" / "learning", "charts/episodic_return"))]
    assert np.mean(returns[:20]) < 2 * RANDOM_POLICY_RETURN
    assert np.mean(returns[-20:]) > THRESHOLD, np.mean(returns[-20:])
