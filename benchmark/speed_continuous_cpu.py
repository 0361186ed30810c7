"""Continuous control, how fast, one after another on this machine: continuous PPO in CleanRL's
exact layout against Stable-Baselines-Jax's PPO, and SAC's whole run against its bare update.

python benchmark/speed_continuous_cpu.py --sbx-python /path/to/venv/bin/python

- PPO: `cleanba_ppo_continuous.py --env-id HalfCheetah-v4 --local-num-envs 1 --num-steps 2048
  --num-actor-threads 1` (CleanRL's layout: one environment, rollouts of 2,048 steps, 10 epochs of
  32 minibatches) for --ppo-steps steps, and sbx's `PPO("MlpPolicy", "HalfCheetah-v4")` with the
  same batch structure and network (n_steps 2048, batch_size 64, n_epochs 10, two tanh layers of
  64), run by --sbx-python (an environment with sbx-rl, the same jax, and gymnasium[mujoco]).
  Steady-state SPS: environment steps between the end of the 2nd update and the end of the last,
  over the wall time between them.
- SAC: `cleanba_sac.py --env-id HalfCheetah-v4` for --sac-steps steps, its logged optimizer steps
  per second once learning runs (the median of its log lines after the first two), against the bare
  update (`make_update`'s compiled scan on random batches, in a process of its own), measured
  before and after the run.
Writes benchmark/results/speed_continuous_cpu.md and .csv.
"""

import argparse
import csv
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from csv_columns import RUN_COLUMNS
from learning_sac_cpu import BARE_MEASURE
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "speed_continuous_cpu"
CLEANRL_LAYOUT = ["--local-num-envs", "1", "--num-steps", "2048", "--num-actor-threads", "1"]
CSV_COLUMNS = [*RUN_COLUMNS, "updates_per_second"]

SBX_PPO = """
import sys, time
import flax.linen as nn
import gymnasium as gym
from sbx import PPO
from stable_baselines3.common.callbacks import BaseCallback

class Times(BaseCallback):
    def __init__(self):
        super().__init__()
        self.marks = []
    def _on_rollout_start(self):
        self.marks.append((self.num_timesteps, time.time()))
    def _on_step(self):
        return True

steps = int(sys.argv[1])
model = PPO(
    "MlpPolicy", gym.make("HalfCheetah-v4"), n_steps=2048, batch_size=64, n_epochs=10,
    learning_rate=3e-4, gamma=0.99, gae_lambda=0.95, clip_range=0.2, ent_coef=0.0, vf_coef=0.5,
    max_grad_norm=0.5, policy_kwargs=dict(net_arch=[64, 64], activation_fn=nn.tanh), seed=1,
)
times = Times()
start = time.time()
model.learn(steps, callback=times)
times.marks.append((model.num_timesteps, time.time()))
(a_steps, a_time), (b_steps, b_time) = times.marks[2], times.marks[-1]
print((b_steps - a_steps) / (b_time - a_time), time.time() - start)
"""


class Row(NamedTuple):
    """One CSV row: a speed run, so no returns (final_return and eval_return stay empty)."""

    script: str
    mode: str
    steps: int
    sps: float | None
    updates_per_second: float | None
    wall_time_s: float


def run_ours(script: str, arguments: list[str], run_name: str, work_dir: Path):
    """Runs cleanba/<script>.py on HalfCheetah-v4 seed 1; its TensorBoard events and wall time."""
    command = [
        sys.executable,
        str(REPO / "cleanba" / f"{script}.py"),
        *["--env-id", "HalfCheetah-v4", "--seed", "1", "--run-name", run_name, *arguments],
    ]
    start = time.time()
    subprocess.run(command, cwd=work_dir, check=True, capture_output=True)
    wall = time.time() - start
    events = EventAccumulator(str(work_dir / "runs" / run_name), size_guidance={"scalars": 0})
    events.Reload()
    return events, wall


def ours_ppo(steps: int, work_dir: Path) -> Row:
    arguments = [*CLEANRL_LAYOUT, "--total-timesteps", str(steps), "--log-frequency", "1"]
    events, wall = run_ours("cleanba_ppo_continuous", arguments, "ppo", work_dir)
    versions = events.Scalars("stats/learner_policy_version")
    sps = (versions[-1].step - versions[1].step) / (versions[-1].wall_time - versions[1].wall_time)
    return Row(
        script="cleanba_ppo_continuous",
        mode="CleanRL's layout",
        steps=steps,
        sps=sps,
        updates_per_second=None,
        wall_time_s=wall,
    )


def sbx_ppo(python: str, steps: int) -> Row:
    start = time.time()
    result = subprocess.run(
        [python, "-c", SBX_PPO, str(steps)], check=True, capture_output=True, text=True
    )
    sps = float(result.stdout.split()[0])
    return Row(
        script="sbx PPO 0.28",
        mode="CleanRL's layout",
        steps=steps,
        sps=sps,
        updates_per_second=None,
        wall_time_s=time.time() - start,
    )


def bare_sac() -> float:
    result = subprocess.run(
        [sys.executable, "-c", BARE_MEASURE, "HalfCheetah-v4", "20"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(np.median(json.loads(result.stdout.strip().splitlines()[-1])["rates"]))


def ours_sac(steps: int, work_dir: Path) -> Row:
    events, wall = run_ours("cleanba_sac", ["--total-timesteps", str(steps)], "sac", work_dir)
    rates = [e.value for e in events.Scalars("stats/optimizer_steps_per_second")][2:]
    return Row(
        script="cleanba_sac",
        mode="whole run",
        steps=steps,
        sps=None,
        updates_per_second=float(np.median(rates)),
        wall_time_s=wall,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sbx-python", required=True)
    parser.add_argument("--ppo-steps", type=int, default=204_800)
    parser.add_argument("--sac-steps", type=int, default=40_000)
    options = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        rows.append(ours_ppo(options.ppo_steps, Path(work_dir)))
        print(rows[-1], flush=True)
        rows.append(sbx_ppo(options.sbx_python, options.ppo_steps))
        print(rows[-1], flush=True)
        bare_before = bare_sac()
        print(f"bare SAC update: {bare_before:.1f}/s", flush=True)
        rows.append(ours_sac(options.sac_steps, Path(work_dir)))
        print(rows[-1], flush=True)
        bare_after = bare_sac()
        print(f"bare SAC update: {bare_after:.1f}/s", flush=True)
    bare = (bare_before + bare_after) / 2
    rows.append(
        Row(
            script="cleanba_sac",
            mode="bare update",
            steps=0,
            sps=None,
            updates_per_second=bare,
            wall_time_s=0.0,
        ),
    )
    number = lambda value, digits: "" if value is None else f"{value:.{digits}f}"
    with open(OUT.with_suffix(".csv"), "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            writer.writerow(
                [
                    row.script,
                    row.mode,
                    "HalfCheetah-v4",
                    1,
                    row.steps,
                    "",
                    "",
                    number(row.sps, 1),
                    number(row.wall_time_s, 0),
                    number(row.updates_per_second, 1),
                ]
            )
    cpu = next(
        line.split(":")[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    )
    ppo_ratio = rows[0].sps / rows[1].sps
    sac_share = rows[2].updates_per_second / bare
    OUT.with_suffix(".md").write_text(
        f"# Continuous control speed, CPU ({time.strftime('%Y-%m-%d')})\n\n"
        f"Machine: {platform.machine()}, {cpu}, nothing else running. Made by "
        f"`python benchmark/speed_continuous_cpu.py --sbx-python PYTHON --ppo-steps "
        f"{options.ppo_steps} --sac-steps {options.sac_steps}`.\n\n"
        "| what | SPS | updates/s |\n|---|---|---|\n"
        f"| continuous PPO, CleanRL's layout | {rows[0].sps:.0f} | |\n"
        f"| sbx PPO, same layout | {rows[1].sps:.0f} | |\n"
        f"| SAC, whole run | | {rows[2].updates_per_second:.1f} |\n"
        f"| SAC, bare update (before / after the run) | | {bare_before:.1f} / {bare_after:.1f} |\n"
        f"\nPPO against sbx: {ppo_ratio:.2f}x. SAC's run at {sac_share:.0%} of its bare update.\n"
    )
    print(OUT.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
