"""Every script must learn CartPole-v1. Provisional: thresholds are being remeasured over seeds 1-10."""

from typing import NamedTuple

import numpy as np
import pytest
from helpers import run_script, scalars


class LearningTest(NamedTuple):
    script: str
    args: list
    devices: int
    threshold: float


def learning_score(returns) -> float:
    """The mean of the last 20 episodes' returns (in step order)."""
    return float(np.mean(returns[-20:]))


COMMON = "--env-id CartPole-v1 --hiddens 64 64 --local-num-envs 4 --seed 1 --log-frequency 1000 --run-name learning"
CLEANRL_PPO = " --num-actor-threads 1 --num-steps 128 --clip-coef 0.2 --clip-vloss --gradient-accumulation-steps 1"
APEX = (
    " --num-steps 8 --learning-starts 1000 --buffer-size 20000 --batch-size 32 --updates-per-rollout 4"
    " --learning-rate 1e-3 --target-update-period 200 --total-timesteps 30000"
)
GALA = "--env-id CartPole-v1 --hiddens 64 64 --total-timesteps 100000 --log-frequency 1000 --seed 1 --run-name learning"
LEARNING_TESTS = {
    "ppo": LearningTest(
        "cleanba_ppo.py", (COMMON + CLEANRL_PPO + " --total-timesteps 200000").split(), 1, 350
    ),
    "impala": LearningTest(
        "cleanba_impala.py", (COMMON + " --total-timesteps 100000").split(), 1, 60
    ),
    "apex_dqn": LearningTest(
        "cleanba_apex_dqn.py", (COMMON.replace("--seed 1", "--seed 2") + APEX).split(), 1, 100
    ),
    "gala_a2c": LearningTest("cleanba_gala_a2c.py", GALA.split(), 4, 40),
}
RANDOM_POLICY_RETURN = 22


@pytest.mark.parametrize("name", list(LEARNING_TESTS))
def test_script_learns_cartpole(tmp_path, name):
    test = LEARNING_TESTS[name]
    result = run_script(test.script, test.args, tmp_path, devices=test.devices)
    assert result.returncode == 0, result.stderr[-3000:]
    # Sorted by step: actor threads log their episodes in either order.
    returns = [
        value
        for _, value in sorted(scalars(tmp_path / "runs" / "learning", "charts/episodic_return"))
    ]
    assert np.mean(returns[:20]) < 2 * RANDOM_POLICY_RETURN
    assert learning_score(returns) > test.threshold, learning_score(returns)
