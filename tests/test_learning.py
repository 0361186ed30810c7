"""Both scripts must learn CartPole-v1: a fixed seed and step budget, and a return far above random.

A uniformly random policy averages about 22 on CartPole-v1. In benchmark/results/learning_cpu.md
(the same settings, 500k steps, 3 seeds) every run of both scripts averages well above 50 by 100k
steps, so 50 leaves a margin for float differences between machines while a learner that stopped
learning (or learns from the wrong data) stays near 22."""

import numpy as np
import pytest
from conftest import run_script, scalars

CARTPOLE = ["--env-id", "CartPole-v1", "--hiddens", 64, 64, "--local-num-envs", 4, "--total-timesteps", 100_000,
            "--seed", 1, "--log-frequency", 1000, "--run-name", "learning"]
RANDOM_POLICY_RETURN = 22
THRESHOLD = 50


@pytest.mark.parametrize("script", ["cleanba_ppo.py", "cleanba_impala.py"])
def test_script_learns_cartpole(tmp_path, script):
    result = run_script(script, CARTPOLE, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    returns = [value for _, value in scalars(tmp_path / "runs" / "learning", "charts/episodic_return")]
    assert np.mean(returns[:20]) < 2 * RANDOM_POLICY_RETURN
    assert np.mean(returns[-20:]) > THRESHOLD, np.mean(returns[-20:])
