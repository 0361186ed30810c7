"""Learner memory does not grow with the number of gradient steps of an update: PPO, whose update
multiplies epochs, minibatches and microbatches, runs one update with the default network and the
default structure (4 epochs x 4 minibatches x 4 microbatches: 64 steps of 8 observations, on 2 envs
x 128 steps), and its peak resident memory (the whole process, envpool's threads included) stays
under a bound.

Measured 2026-11-21 on 2 CPU cores with this command: 1.11 and 1.16 GiB (two runs). The same command
with the script as it was when the CPU learner unrolled its epoch and minibatch loops (revision
1c5754f, which kept every step's activations alive): 5.65 GiB. The bound, 2 GiB, leaves 70 % above
today's measurements and fails at a third of the unrolled learner's excess."""

import pytest
from helpers import REPO
from measure import run_measured

BOUND_GIB = 2.0
COMMAND = (
    "--env-id Breakout-v5 --num-actor-threads 1 --local-num-envs 2 --total-timesteps 256"
    " --run-name memory"
)


@pytest.mark.long
def test_one_default_update_stays_under_the_memory_bound(tmp_path):
    measured = run_measured(
        [str(REPO / "cleanba" / "cleanba_ppo.py"), *COMMAND.split()], tmp_path, tmp_path / "log"
    )
    assert measured["exit_code"] == 0, (tmp_path / "log").read_text()[-3000:]
    assert measured["peak_rss_gib"] < BOUND_GIB, measured
