"""Both scripts must learn CartPole-v1, PPO as well as CleanRL's PPO does with CleanRL's own settings.

PPO runs CleanRL `ppo.py`'s CartPole-v1 hyperparameters (see benchmark/parity_cartpole.py) for 200k steps, seed
1. Measured 2026-11-21 (`python benchmark/parity_cartpole.py --variants cleanrl shared_torso --seeds 1 2 3
--timesteps 200000`), the mean of the last 20 episodes: 448, 430 and 416 for seeds 1-3; the shared-torso network that
PPO had before (revision ca8dbf1, no value clipping) gave 254, 171 and 242. A threshold of 350 catches that gap
with 66 or more to spare on either side.

IMPALA runs the paper's settings with a small MLP and 2 x 4 environments for 100k steps, seed 1: its separate MLPs
reach a running mean of 195 by 45k steps on seeds 1-3 (benchmark/results/learning_cpu.md), and this run's last 20
episodes averaged 304 at 100k steps (2026-11-22); 60 leaves a wide margin for float differences between machines,
while a learner that stopped learning (or learns from the wrong data) stays near random play, about 22."""

import numpy as np
import pytest
from helpers import run_script, scalars

COMMON = "--env-id CartPole-v1 --hiddens 64 64 --local-num-envs 4 --seed 1 --log-frequency 1000 --run-name learning"
CLEANRL_PPO = " --num-actor-threads 1 --num-steps 128 --clip-coef 0.2 --clip-vloss --gradient-accumulation-steps 1"
CLEANRL_PPO += " --total-timesteps 200000"
RANDOM_POLICY_RETURN = 22
PPO_THRESHOLD = 350
IMPALA_THRESHOLD = 60


@pytest.mark.parametrize(
    "script, args, threshold",
    [
        ("cleanba_ppo.py", COMMON + CLEANRL_PPO, PPO_THRESHOLD),
        ("cleanba_impala.py", COMMON + " --total-timesteps 100000", IMPALA_THRESHOLD),
    ],
)
def test_script_learns_cartpole(tmp_path, script, args, threshold):
    result = run_script(script, args.split(), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # Sorted by step: actor threads log their episodes in either order.
    returns = [value for _, value in sorted(scalars(tmp_path / "runs" / "learning", "charts/episodic_return"))]
    assert np.mean(returns[:20]) < 2 * RANDOM_POLICY_RETURN
    assert np.mean(returns[-20:]) > threshold, np.mean(returns[-20:])
