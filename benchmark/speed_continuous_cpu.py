"""Continuous control, how fast, one after another on this machine: continuous PPO in CleanRL's
exact layout against Stable-Baselines-Jax's PPO, SAC's whole run against its bare update, and the
time to CleanRL's HalfCheetah-v4 score, each the median of --repeats runs.

python benchmark/speed_continuous_cpu.py --sbx-python /path/to/venv/bin/python

- PPO: `cleanba_ppo_continuous.py --env-id HalfCheetah-v4 --local-num-envs 1 --num-steps 2048
  --num-actor-threads 1` (CleanRL's layout: one environment, rollouts of 2,048 steps, 10 epochs of
  32 minibatches) for --ppo-steps steps, and sbx's `PPO("MlpPolicy", "HalfCheetah-v4")` with the
  same batch structure and network (n_steps 2048, batch_size 64, n_epochs 10, two tanh layers of
  64), run by --sbx-python (an environment with sbx-rl, the same jax, and gymnasium[mujoco]).
  Steady-state SPS: environment steps between the end of the 2nd update and the end of the last,
  over the wall time between them.
- SAC: `cleanba_sac.py --env-id HalfCheetah-v4` for --sac-steps steps, its logged optimizer steps
  per second once learning runs (the median of its log lines after the first two that learned),
  against the bare update (`make_update`'s compiled scan on random batches, in a process of its
  own), measured before and after the run.
- Ape-X DPG at its defaults on HalfCheetah-v4 for --dpg-steps steps (one run): its SPS.
- Each script's actor time per environment step: the median of its logged rollout times after the
  first two, over a rollout's environment steps.
- Time to score: the wall-clock, from the process's start, until the mean return of the last 100
  training episodes first reaches CleanRL's 1M-step HalfCheetah-v4 mean (TARGET_RETURN), for our
  script at its defaults and for sbx's PPO with CleanRL's settings (the learning rate annealed to 0,
  observations and rewards normalized by `VecNormalize`), seeds 1 to --repeats, up to
  --score-steps steps (a run that never reaches it says so).
Writes benchmark/results/speed_continuous_cpu.md, .csv (one row per run) and .png.
"""

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import matplotlib
import numpy as np
from csv_columns import RUN_COLUMNS
from learning_sac_cpu import BARE_MEASURE
from measure import stack_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "speed_continuous_cpu"
CLEANRL_LAYOUT = ["--local-num-envs", "1", "--num-steps", "2048", "--num-actor-threads", "1"]
CSV_COLUMNS = [*RUN_COLUMNS, "updates_per_second", "seconds_to_target", "actor_us_per_step"]
TARGET_RETURN = 1442.64
"""CleanRL's ppo_continuous_action.py on HalfCheetah-v4 after 1M steps (its documented mean)"""

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
        self.shown = time.time()
    def _on_rollout_start(self):
        self.marks.append((self.num_timesteps, time.time()))
    def _on_step(self):
        if time.time() - self.shown > 50:
            self.shown = time.time()
            print(f"sbx PPO: {self.num_timesteps} steps", file=sys.stderr, flush=True)
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


SBX_TIME_TO_SCORE = """
import json, sys, time
start = time.time()
import flax.linen as nn
import gymnasium as gym
import numpy as np
from sbx import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

seed, steps, target = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

# Stops at the first episode after which the mean of the last 100 reaches the target; keeps
# (seconds since the start, that mean) at every episode's end for the plot.
class FirstReach(BaseCallback):
    reached = None
    curve = []
    shown = time.time()
    def _on_step(self):
        # Called before the step's episodes join ep_info_buffer.
        ended = [info["episode"]["r"] for info in self.locals["infos"] if "episode" in info]
        if not ended:
            return True
        mean = float(np.mean(([info["r"] for info in self.model.ep_info_buffer] + ended)[-100:]))
        self.curve.append((time.time() - start, mean))
        if time.time() - self.shown > 50:
            self.shown = time.time()
            print(f"sbx PPO seed {seed}: {self.num_timesteps} steps, return {mean:.1f}",
                  file=sys.stderr, flush=True)
        if mean >= target:
            self.reached = (self.num_timesteps, time.time() - start)
            return False
        return True

env = VecNormalize(DummyVecEnv([lambda: Monitor(gym.make("HalfCheetah-v4"))]), gamma=0.99)
model = PPO(
    "MlpPolicy", env, learning_rate=lambda remaining: 3e-4 * remaining, n_steps=2048,
    batch_size=64, n_epochs=10, gamma=0.99, gae_lambda=0.95, clip_range=0.2, ent_coef=0.0,
    vf_coef=0.5, max_grad_norm=0.5, policy_kwargs=dict(net_arch=[64, 64], activation_fn=nn.tanh),
    seed=seed,
)
callback = FirstReach()
model.learn(steps, callback=callback)
# The running mean at the last episode's end (the buffer leaves out the episode that stopped it).
print(json.dumps(dict(reached=callback.reached, steps=model.num_timesteps,
                      final_return=callback.curve[-1][1], wall=time.time() - start,
                      curve=callback.curve)))
"""


class Row(NamedTuple):
    """One CSV row: a speed run (no returns) or a time-to-score run (its final return)."""

    script: str
    mode: str
    seed: int
    steps: int
    sps: float | None
    updates_per_second: float | None
    wall_time_s: float
    final_return: float | None = None
    seconds_to_target: float | None = None
    actor_us_per_step: float | None = None


def actor_us_per_step(events, steps_per_rollout: int) -> float:
    """An actor thread's microseconds per environment step: the median of its logged rollout times
    (the compiled program and the bookkeeping after it) after the first two (compilation), over the
    environment steps of one rollout."""
    rollout_times = [event.value for event in events.Scalars("stats/rollout_time")][2:]
    return float(np.median(rollout_times)) / steps_per_rollout * 1e6


def run_ours(script: str, arguments: list[str], run_name: str, work_dir: Path, seed: int = 1):
    """Runs cleanba/<script>.py on HalfCheetah-v4; its TensorBoard events and wall time."""
    command = [
        sys.executable,
        str(REPO / "cleanba" / f"{script}.py"),
        *["--env-id", "HalfCheetah-v4", "--seed", str(seed), "--run-name", run_name, *arguments],
    ]
    start = time.time()
    # The script's console lines (one at least every minute) show the benchmark's progress.
    subprocess.run(command, cwd=work_dir, check=True)
    wall = time.time() - start
    events = EventAccumulator(str(work_dir / "runs" / run_name), size_guidance={"scalars": 0})
    events.Reload()
    return events, wall


def ours_ppo(steps: int, work_dir: Path, repeat: int) -> Row:
    arguments = [*CLEANRL_LAYOUT, "--total-timesteps", str(steps), "--log-frequency", "1"]
    events, wall = run_ours("cleanba_ppo_continuous", arguments, f"ppo_{repeat}", work_dir)
    versions = events.Scalars("stats/learner_policy_version")
    sps = (versions[-1].step - versions[1].step) / (versions[-1].wall_time - versions[1].wall_time)
    return Row(
        script="cleanba_ppo_continuous",
        mode="CleanRL's layout",
        seed=1,
        steps=steps,
        sps=sps,
        updates_per_second=None,
        wall_time_s=wall,
        actor_us_per_step=actor_us_per_step(events, 2048),
    )


def sbx_ppo(python: str, steps: int, work_dir: Path) -> Row:
    start = time.time()
    # In the work folder: MuJoCo writes its warnings to MUJOCO_LOG.TXT there.
    result = subprocess.run(
        [python, "-c", SBX_PPO, str(steps)],
        cwd=work_dir,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    sps = float(result.stdout.split()[0])
    return Row(
        script="sbx PPO 0.28",
        mode="CleanRL's layout",
        seed=1,
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


def ours_sac(steps: int, work_dir: Path, repeat: int) -> Row:
    arguments = ["--total-timesteps", str(steps)]
    events, wall = run_ours("cleanba_sac", arguments, f"sac_{repeat}", work_dir)
    # The log lines once learning runs (the earlier ones count no gradient updates), without the
    # first two (the update's compilation).
    rates = [e.value for e in events.Scalars("stats/optimizer_steps_per_second") if e.value > 0][2:]
    return Row(
        script="cleanba_sac",
        mode="whole run",
        seed=1,
        steps=steps,
        sps=None,
        updates_per_second=float(np.median(rates)),
        wall_time_s=wall,
        actor_us_per_step=actor_us_per_step(events, 64),
    )


def ours_dpg(steps: int, work_dir: Path) -> Row:
    """Ape-X DPG at its defaults (2 actor threads x 32 environments x 40 steps): its SPS and the
    actors' time per step."""
    arguments = ["--total-timesteps", str(steps), "--log-frequency", "1"]
    events, wall = run_ours("cleanba_apex_dpg", arguments, "dpg", work_dir)
    versions = events.Scalars("stats/learner_policy_version")
    sps = (versions[-1].step - versions[1].step) / (versions[-1].wall_time - versions[1].wall_time)
    return Row(
        script="cleanba_apex_dpg",
        mode="defaults",
        seed=1,
        steps=steps,
        sps=sps,
        updates_per_second=None,
        wall_time_s=wall,
        actor_us_per_step=actor_us_per_step(events, 32 * 40),
    )


def running_means(returns: list, start: float) -> list[tuple[float, float]]:
    """(seconds since `start`, mean of the last 100 training returns) at every episode's end.
    `returns`: TensorBoard scalars."""
    window = []
    curve = []
    for event in returns:
        window = [*window[-99:], event.value]
        curve.append((event.wall_time - start, float(np.mean(window))))
    return curve


def first_reach(curve: list[tuple[float, float]]) -> float | None:
    """The seconds until the running mean first reaches TARGET_RETURN; None if it never does."""
    return next((seconds for seconds, mean in curve if mean >= TARGET_RETURN), None)


def ours_time_to_score(seed: int, steps: int, work_dir: Path) -> tuple[Row, list]:
    """Our script at its defaults, run to the end: its row and its running-mean curve."""
    start = time.time()
    arguments = ["--total-timesteps", str(steps)]
    events, wall = run_ours("cleanba_ppo_continuous", arguments, f"score_{seed}", work_dir, seed)
    returns = events.Scalars("charts/episodic_return")
    curve = running_means(returns, start)
    row = Row(
        script="cleanba_ppo_continuous",
        mode="time to score, defaults",
        seed=seed,
        steps=steps,
        sps=None,
        updates_per_second=None,
        wall_time_s=wall,
        final_return=float(np.mean([event.value for event in returns[-100:]])),
        seconds_to_target=first_reach(curve),
    )
    return row, curve


def sbx_time_to_score(python: str, seed: int, steps: int, work_dir: Path) -> tuple[Row, list]:
    """sbx's PPO, stopped when it reaches the target: its row and its running-mean curve."""
    result = subprocess.run(
        [python, "-c", SBX_TIME_TO_SCORE, str(seed), str(steps), str(TARGET_RETURN)],
        cwd=work_dir,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    reached = outcome["reached"]
    row = Row(
        script="sbx PPO 0.28",
        mode="time to score, CleanRL's settings, VecNormalize",
        seed=seed,
        steps=outcome["steps"],
        sps=None,
        updates_per_second=None,
        wall_time_s=outcome["wall"],
        final_return=outcome["final_return"],
        seconds_to_target=None if reached is None else reached[1],
    )
    return row, outcome["curve"]


def median_of(rows: list, field: str) -> float:
    return float(np.median([getattr(row, field) for row in rows]))


def seconds_to_target_cell(rows: list) -> str:
    """The median over the seeds that reached the target, and how many did."""
    reached = [row.seconds_to_target for row in rows if row.seconds_to_target is not None]
    if not reached:
        return f"never, in {rows[0].steps:,} steps ({len(rows)} seeds)"
    return f"{np.median(reached) / 60:.1f} min ({len(reached)} of {len(rows)} seeds reached it)"


def seed_line(row: Row) -> str:
    """A time-to-score run's line of the report's table."""
    minutes = "never" if row.seconds_to_target is None else f"{row.seconds_to_target / 60:.2f}"
    return f"| {row.script} | {row.seed} | {minutes} | {row.steps:,} | {row.final_return:.1f} |\n"


def write_csv(rows: list):
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
                    row.seed,
                    row.steps,
                    number(row.final_return, 1),
                    "",
                    number(row.sps, 1),
                    number(row.wall_time_s, 0),
                    number(row.updates_per_second, 1),
                    number(row.seconds_to_target, 0),
                    number(row.actor_us_per_step, 1),
                ]
            )


def plot(ppo_rows: dict, sac_rows: list, bare_rates: list, curves: dict):
    """Three panels: PPO's SPS in CleanRL's layout (ours, sbx), SAC's whole run against its bare
    update, and the running mean of training returns against wall-clock time."""
    figure, (sps_axis, sac_axis, score_axis) = plt.subplots(1, 3, figsize=(16, 4.5))
    for position, (name, rows) in enumerate(ppo_rows.items()):
        sps_axis.scatter([position] * len(rows), [row.sps for row in rows], label=name)
    sps_axis.set_xticks(range(len(ppo_rows)), list(ppo_rows))
    sps_axis.set_ylim(bottom=0)
    sps_axis.set_ylabel("environment steps per second")
    sps_axis.set_title("PPO, CleanRL's layout, HalfCheetah-v4")
    sac_axis.scatter([0] * len(sac_rows), [row.updates_per_second for row in sac_rows])
    sac_axis.scatter([1] * len(bare_rates), bare_rates)
    sac_axis.set_xticks([0, 1], ["whole run", "bare update"])
    sac_axis.set_ylim(bottom=0)
    sac_axis.set_ylabel("gradient updates per second")
    sac_axis.set_title("SAC, HalfCheetah-v4")
    for color, (name, runs) in zip(["C0", "C1"], curves.items()):
        for index, curve in enumerate(runs):
            minutes = [seconds / 60 for seconds, _ in curve]
            means = [mean for _, mean in curve]
            score_axis.plot(minutes, means, color=color, label=name if index == 0 else None)
    score_axis.axhline(TARGET_RETURN, color="gray", linestyle="--", label="CleanRL's 1M-step mean")
    score_axis.set_xlabel("wall-clock minutes")
    score_axis.set_ylabel("mean of the last 100 training returns")
    score_axis.set_title("time to score, HalfCheetah-v4, one line per seed")
    score_axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(OUT.with_suffix(".png"), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sbx-python", required=True)
    parser.add_argument("--ppo-steps", type=int, default=204_800)
    parser.add_argument("--sac-steps", type=int, default=40_000)
    parser.add_argument("--dpg-steps", type=int, default=204_800)
    parser.add_argument("--score-steps", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--note", default="", help="how the machine was shared, for the report")
    options = parser.parse_args()
    ours_ppo_rows = []
    sbx_rows = []
    sac_rows = []
    bare_rates = []
    ours_score_rows = []
    sbx_score_rows = []
    ours_curves = []
    sbx_curves = []
    with tempfile.TemporaryDirectory() as work_dir:
        for repeat in range(options.repeats):
            ours_ppo_rows.append(ours_ppo(options.ppo_steps, Path(work_dir), repeat))
            print(ours_ppo_rows[-1], flush=True)
            sbx_rows.append(sbx_ppo(options.sbx_python, options.ppo_steps, Path(work_dir)))
            print(sbx_rows[-1], flush=True)
            bare_rates.append(bare_sac())
            sac_rows.append(ours_sac(options.sac_steps, Path(work_dir), repeat))
            print(sac_rows[-1], flush=True)
            bare_rates.append(bare_sac())
            print(f"bare SAC update: {bare_rates[-2]:.1f}/s, {bare_rates[-1]:.1f}/s", flush=True)
        dpg_row = ours_dpg(options.dpg_steps, Path(work_dir))
        print(dpg_row, flush=True)
        for seed in range(1, options.repeats + 1):
            row, curve = ours_time_to_score(seed, options.score_steps, Path(work_dir))
            ours_score_rows.append(row)
            ours_curves.append(curve)
            print(row, flush=True)
            row, curve = sbx_time_to_score(
                options.sbx_python, seed, options.score_steps, Path(work_dir)
            )
            sbx_score_rows.append(row)
            sbx_curves.append(curve)
            print(row, flush=True)
    bare = float(np.median(bare_rates))
    bare_row = Row(
        script="cleanba_sac",
        mode="bare update",
        seed=1,
        steps=0,
        sps=None,
        updates_per_second=bare,
        wall_time_s=0.0,
    )
    write_csv(
        [*ours_ppo_rows, *sbx_rows, *sac_rows, bare_row, dpg_row, *ours_score_rows, *sbx_score_rows]
    )
    plot(
        ppo_rows={"continuous PPO": ours_ppo_rows, "sbx PPO": sbx_rows},
        sac_rows=sac_rows,
        bare_rates=bare_rates,
        curves={"continuous PPO, defaults": ours_curves, "sbx PPO, VecNormalize": sbx_curves},
    )
    cpu = next(
        line.split(":")[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    )
    sbx_version = subprocess.run(
        [options.sbx_python, "-c", "import sbx; print(sbx.__version__)"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    ours_sps = median_of(ours_ppo_rows, "sps")
    sbx_sps = median_of(sbx_rows, "sps")
    sac_rate = median_of(sac_rows, "updates_per_second")
    OUT.with_suffix(".md").write_text(
        f"# Continuous control speed, CPU ({time.strftime('%Y-%m-%d')})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.machine()}, {cpu}, {len(os.sched_getaffinity(0))} CPU cores. "
        f"{options.note} Made by `python benchmark/speed_continuous_cpu.py --sbx-python PYTHON "
        f"--ppo-steps {options.ppo_steps} --sac-steps {options.sac_steps} "
        f"--dpg-steps {options.dpg_steps} --score-steps {options.score_steps} "
        f"--repeats {options.repeats}`, sbx-rl {sbx_version} in PYTHON; "
        f"medians of {options.repeats} runs (every run in speed_continuous_cpu.csv; the runs "
        "took turns, PPO, sbx PPO and SAC in each repeat, then the time-to-score seeds).\n\n"
        "| what | SPS | updates/s |\n|---|---|---|\n"
        f"| continuous PPO, CleanRL's layout | {ours_sps:.0f} | |\n"
        f"| sbx PPO, same layout | {sbx_sps:.0f} | |\n"
        f"| SAC, whole run | | {sac_rate:.1f} |\n"
        f"| SAC, bare update (before and after each run) | | {bare:.1f} |\n"
        f"\nPPO against sbx: {ours_sps / sbx_sps:.2f}x. SAC's run at {sac_rate / bare:.0%} of its "
        "bare update.\n\n"
        "An actor thread's time per environment step (its rollout, compiled program and "
        "bookkeeping, over the rollout's environment steps; the median over its rollouts after the "
        "first two):\n\n| what | layout | µs per environment step |\n|---|---|---|\n"
        f"| continuous PPO | 1 environment x 2,048 steps | "
        f"{median_of(ours_ppo_rows, 'actor_us_per_step'):.1f} |\n"
        f"| SAC | 1 environment x 64 steps | {median_of(sac_rows, 'actor_us_per_step'):.1f} |\n"
        f"| Ape-X DPG (one run, {dpg_row.sps:.0f} SPS) | 2 threads x 32 environments x 40 steps | "
        f"{dpg_row.actor_us_per_step:.1f} |\n\n"
        f"Time until the mean of the last 100 training returns first reaches {TARGET_RETURN} "
        "(CleanRL's 1M-step HalfCheetah-v4 mean), from the process's start:\n\n"
        "| what | time to the target |\n|---|---|\n"
        f"| continuous PPO, defaults | {seconds_to_target_cell(ours_score_rows)} |\n"
        "| sbx PPO, CleanRL's settings and VecNormalize | "
        f"{seconds_to_target_cell(sbx_score_rows)} |\n\n"
        "Each seed (minutes to the target; the final return is that of the last 100 episodes "
        "when the run stopped: at the target for sbx, at the end for ours):\n\n"
        "| what | seed | minutes to the target | steps run | final return |\n"
        "|---|---|---|---|---|\n"
        + "".join(seed_line(row) for row in [*ours_score_rows, *sbx_score_rows])
        + "\n![speed](speed_continuous_cpu.png)\n"
    )
    print(OUT.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
