"""Evaluation during training, the same in every on-policy script as in the off-policy ones:
--eval-episodes episodes of the untrained policy at step 0 (as SLM Lab's first checkpoint), every
--eval-every updates and after the last, their mean logged as charts/eval_return and the learner's
optimizer steps so far as charts/opt_step at the update's global step; summary.json lists them, and
the final evaluation is the last update's."""

import json

import pytest
from helpers import run_script, scalars

CARTPOLE = ["--env-id", "CartPole-v1", "--hiddens", 16, "--log-frequency", 1]
# 5 updates each; evaluations before the first update and after updates 2, 4 and 5 (the last).
SCRIPTS = {
    "cleanba_ppo.py": dict(
        args=[
            *["--local-num-envs", 4, "--num-actor-threads", 1, "--num-steps", 16],
            *["--num-minibatches", 2, "--update-epochs", 3, "--gradient-accumulation-steps", 2],
            *["--total-timesteps", 320],
        ],
        steps_per_update=64,
        # Every epoch's every minibatch.
        optimizer_steps_per_update=3 * 2,
    ),
    "cleanba_impala.py": dict(
        args=[
            *["--local-num-envs", 4, "--num-actor-threads", 1, "--num-steps", 16],
            *["--num-minibatches", 2, "--total-timesteps", 320],
        ],
        steps_per_update=64,
        optimizer_steps_per_update=2,
    ),
    "cleanba_gala_a2c.py": dict(
        args=[*["--local-num-envs", 2, "--num-steps", 4, "--total-timesteps", 160]],
        steps_per_update=32,
        # One per agent per update.
        optimizer_steps_per_update=1,
    ),
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_evaluations_every_few_updates_with_the_optimizer_steps(tmp_path, script):
    config = SCRIPTS[script]
    args = [*CARTPOLE, *config["args"], "--eval-episodes", 2, "--eval-every", 2]
    result = run_script(script, [*args, "--run-name", "evaluated"], tmp_path, devices=4)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "evaluated"
    updates = [0, 2, 4, 5]
    steps = [update * config["steps_per_update"] for update in updates]
    optimizer_steps = [update * config["optimizer_steps_per_update"] for update in updates]
    assert scalars(run_dir, "charts/opt_step") == list(zip(steps, optimizer_steps))
    eval_returns = scalars(run_dir, "charts/eval_return")
    assert [step for step, _ in eval_returns] == steps
    # CartPole's returns are whole numbers; two episodes' mean a multiple of a half.
    assert all(value >= 8 and (2 * value).is_integer() for _, value in eval_returns)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [step for step, _ in summary["eval_returns"]] == steps
    # The final evaluation's episodes are the last update's evaluation, not others played again.
    final_episodes = [value for _, value in scalars(run_dir, "eval/episodic_return")]
    assert len(final_episodes) == 2
    assert sum(final_episodes) / 2 == pytest.approx(eval_returns[-1][1])
    assert result.stdout.count("eval: mean return") == 5  # four evaluations and the final line
