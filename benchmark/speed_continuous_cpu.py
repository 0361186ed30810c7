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

import numpy as np
from learning_sac_cpu import BARE_MEASURE
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "speed_continuous_cpu"
CLEANRL_LAYOUT = ["--local-num-envs", "1", "--num-steps", "2048", "--num-actor-threads", "1"]
CSV_COLUMNS = ["what", "env_id", "steps", "sps", "updates_per_second", "wall_time_s"]

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


def ours_ppo(steps: int, work_dir: Path) -> dict:
    command = [
        sys.executable,
        str(REPO / "cleanba" / "cleanba_ppo_continuous.py"),
        *["--env-id", "HalfCheetah-v4", *CLEANRL_LAYOUT, "--total-timesteps", str(steps)],
        *["--log-frequency", "1", "--run-name", "ppo"],
    ]
    start = time.time()
    subprocess.run(command, cwd=work_dir, check=True, capture_output=True)
    wall = time.time() - start
    events = EventAccumulator(str(work_dir / "runs" / "ppo"), size_guidance={"scalars": 0})
    events.Reload()
    versions = events.Scalars("stats/learner_policy_version")
    sps = (versions[-1].step - versions[1].step) / (versions[-1].wall_time - versions[1].wall_time)
    return dict(what="cleanba_ppo_continuous, CleanRL's layout", steps=steps, sps=sps, wall=wall)


def sbx_ppo(python: str, steps: int) -> dict:
    start = time.time()
    result = subprocess.run(
        [python, "-c", SBX_PPO, str(steps)], check=True, capture_output=True, text=True
    )
    sps = float(result.stdout.split()[0])
    return dict(what="sbx PPO, same layout", steps=steps, sps=sps, wall=time.time() - start)


def bare_sac() -> float:
    result = subprocess.run(
        [sys.executable, "-c", BARE_MEASURE, "HalfCheetah-v4", "20"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(np.median(json.loads(result.stdout.strip().splitlines()[-1])["rates"]))


def ours_sac(steps: int, work_dir: Path) -> dict:
    command = [
        sys.executable,
        str(REPO / "cleanba" / "cleanba_sac.py"),
        *["--env-id", "HalfCheetah-v4", "--total-timesteps", str(steps), "--run-name", "sac"],
    ]
    start = time.time()
    subprocess.run(command, cwd=work_dir, check=True, capture_output=True)
    wall = time.time() - start
    events = EventAccumulator(str(work_dir / "runs" / "sac"), size_guidance={"scalars": 0})
    events.Reload()
    rates = [e.value for e in events.Scalars("stats/optimizer_steps_per_second")][2:]
    return dict(
        what="cleanba_sac, whole run", steps=steps, updates=float(np.median(rates)), wall=wall
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
    rows.append(dict(what="SAC bare update", steps=0, updates=bare, wall=0.0))
    with open(OUT.with_suffix(".csv"), "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            writer.writerow(
                [
                    row["what"],
                    "HalfCheetah-v4",
                    row["steps"],
                    f"{row['sps']:.1f}" if "sps" in row else "",
                    f"{row['updates']:.1f}" if "updates" in row else "",
                    f"{row['wall']:.0f}",
                ]
            )
    cpu = next(
        line.split(":")[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    )
    ppo_ratio = rows[0]["sps"] / rows[1]["sps"]
    sac_share = rows[2]["updates"] / bare
    OUT.with_suffix(".md").write_text(
        f"# Continuous control speed, CPU ({time.strftime('%Y-%m-%d')})\n\n"
        f"Machine: {platform.machine()}, {cpu}, nothing else running. Made by "
        f"`python benchmark/speed_continuous_cpu.py --sbx-python PYTHON --ppo-steps "
        f"{options.ppo_steps} --sac-steps {options.sac_steps}`.\n\n"
        "| what | SPS | updates/s |\n|---|---|---|\n"
        f"| continuous PPO, CleanRL's layout | {rows[0]['sps']:.0f} | |\n"
        f"| sbx PPO, same layout | {rows[1]['sps']:.0f} | |\n"
        f"| SAC, whole run | | {rows[2]['updates']:.1f} |\n"
        f"| SAC, bare update (before / after the run) | | {bare_before:.1f} / {bare_after:.1f} |\n"
        f"\nPPO against sbx: {ppo_ratio:.2f}x. SAC's run at {sac_share:.0%} of its bare update.\n"
    )
    print(OUT.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
