"""Evidence that cleanba_apex_dpg.py learns, and how fast, on a CPU.

1. The implementation check against CleanRL's JAX DDPG and TD3 at 1M steps, at equal data: DDPG's
   replay ratio, one batch of 256 per environment step (8 environments x 8 steps per update, 64
   optimizer steps per update), 1M steps of HalfCheetah-v4 and Hopper-v4, seeds 1 and 2 (`--seeds
   1 2 3` adds a third), with DDPG's settings where the two differ: relu networks of 256 and 256,
   learning rate 3e-4, noise σ 0.1, 25,000 steps of uniform random actions and learning from then
   on, a slow target (copies every 400 batches), no dq/da clip, and DDPG's 1-step returns
   (`ddpg_settings`). Ape-X's prioritized replay stays. Three ablations at that ratio: Ape-X's
   target copies every 100 batches, its dq/da clip and no random phase, at the seeds of the check
   (`ddpg_settings_apex_parts`), whose Hopper critic overestimated by far in seed 2; the same with
   the paper's 3-step returns on HalfCheetah, seed 1 (`ddpg_settings_3step`), which fell far behind
   1-step ones there (2,662 against 5,317 at 256k steps); and the paper's other settings
   (`paper_settings`: tanh networks of 400-300 and 300-200, 1e-4, σ 0.3, 3-step returns).
2. The paper's setting (the script's defaults: 2 x 32 environments, 16 batches of 256 per 2,560
   steps) on HumanoidStand-v1 (`--paper-env ManipulatorBringBall-v1` for the other task) for
   `--paper-minutes` of wall time: the returns against wall time, and transitions and batches per
   second (the paper: about 14k transitions and 86 batches of 256 per second, 64 actors and a GPU).
3. `--speed`: two HalfCheetah-v4 runs of about 2 minutes each, at the defaults (1.28M steps) and at
   DDPG's ratio (20,480 steps), timed over their learning phase: environment steps and optimizer
   steps per second.

python benchmark/learning_apex_dpg_cpu.py                                    # everything, in turn
python benchmark/learning_apex_dpg_cpu.py --runs halfcheetah_ddpg_settings_1 # some runs
python benchmark/learning_apex_dpg_cpu.py --speed                            # the speed runs only
python benchmark/learning_apex_dpg_cpu.py --report-only                      # the report, no runs

Resuming: the 1M-step runs save a checkpoint every 500 updates (32,000 steps) with their replay
(the script's --checkpoint-replay: about 190 MB for 1M HalfCheetah transitions), so a stopped run
(SIGTERM, Ctrl-C, a crash, a reboot) continues from its newest checkpoint when this script runs it
again, with the replay it had (only the environments restart from a reset); a finished run (its
summary.json) is skipped. The paper-setting run is stopped with SIGTERM when its wall time is spent
(it saves a checkpoint, every 200 updates too) and then counts as done; its sessions' times are kept
in the work dir, and a run stopped early continues for the time left. --report-only writes the
report from whatever runs exist, marking the unfinished ones partial.

Writes benchmark/results/learning_apex_dpg_cpu.md, .csv (one row per run) and .png (the 1M-step
curves), and learning_apex_dpg_cpu_paper.png (the paper-setting run against wall time).
"""

import argparse
import csv
import json
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from csv_columns import RUN_COLUMNS
from measure import command_line, stack_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cleanba_utils.experiments.events import running_mean

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "cleanba_apex_dpg"
DDPG_RATIO = ["--local-num-envs", "8", "--num-actor-threads", "1", "--num-steps", "8"]
DDPG_RATIO += ["--updates-per-rollout", "64"]
# Evaluations every 250 updates (16,000 steps), checkpoints every 500.
CADENCE = [
    "--eval-episodes",
    "10",
    "--eval-every",
    "250",
    "--checkpoint-every",
    "500",
    "--log-frequency",
    "100",
]
DDPG_SETTINGS = ["--first-activation", "relu", "--critic-hiddens", "256", "256"]
DDPG_SETTINGS += ["--actor-hiddens", "256", "256", "--learning-rate", "3e-4", "--noise-std", "0.1"]
DDPG_SETTINGS += ["--learning-starts", "25000"]
# DDPG's in place of three of Ape-X's parts: 25,000 steps of uniform random actions; a slow target
# (DDPG's Polyak averaging, τ 0.005 every 2 updates, trails the critic by about 400 updates; copies
# every 400 trail by 200 on average, the paper's every 100 by 50); no dq/da clip (a bound of 1e6,
# which the runs never reached: losses/actor_grad_clipped stayed 0).
DDPG_OVER_APEX_PARTS = ["--random-steps", "25000", "--target-update-period", "400"]
DDPG_OVER_APEX_PARTS += ["--actor-grad-clip", "1000000"]
MODES = {
    "ddpg_settings": [
        *DDPG_RATIO,
        *DDPG_SETTINGS,
        *DDPG_OVER_APEX_PARTS,
        "--n-step",
        "1",
        *CADENCE,
    ],
    "ddpg_settings_apex_parts": [*DDPG_RATIO, *DDPG_SETTINGS, "--n-step", "1", *CADENCE],
    "ddpg_settings_3step": [*DDPG_RATIO, *DDPG_SETTINGS, *CADENCE],
    "paper_settings": [*DDPG_RATIO, *CADENCE],
    "paper": [
        "--total-timesteps",
        "100000000",
        "--eval-episodes",
        "10",
        "--eval-every",
        "20",
        "--checkpoint-every",
        "200",
        "--log-frequency",
        "20",
    ],
}
SPEED = {
    # The defaults (learning from 50,000 transitions on), 500 updates: about 2 minutes here.
    "speed_defaults": ["--total-timesteps", "1280000", "--log-frequency", "50"],
    "speed_ddpg_ratio": [
        *DDPG_RATIO,
        "--total-timesteps",
        "20480",
        "--learning-starts",
        "5000",
        "--log-frequency",
        "50",
    ],
}
LAST_EPISODES = 100
# CleanRL's JAX DDPG and TD3 (ddpg_continuous_action_jax.py, td3_continuous_action_jax.py), 1M
# steps, the v4 tasks: the mean and standard deviation over seeds of their final episodic returns
# (CleanRL's documentation, benchmark tables).
CLEANRL_DDPG = {"HalfCheetah-v4": (8639, 1954), "Hopper-v4": (1209, 659)}
CLEANRL_TD3 = {"HalfCheetah-v4": (9346, 771), "Hopper-v4": (2940, 656)}
CSV_COLUMNS = [*RUN_COLUMNS, "updates_per_second", "status"]


def plan(seeds: list[int], paper_env: str) -> dict:
    """Run name -> (env_id, mode, seed), in the order they run: the implementation check's seeds
    first."""
    runs = {}
    for seed in seeds:
        for env_id in ["HalfCheetah-v4", "Hopper-v4"]:
            name = f"{env_id.split('-')[0].lower()}_ddpg_settings_{seed}"
            runs[name] = (env_id, "ddpg_settings", seed)
    for seed in seeds:
        for env_id in ["HalfCheetah-v4", "Hopper-v4"]:
            name = f"{env_id.split('-')[0].lower()}_ddpg_settings_apex_parts_{seed}"
            runs[name] = (env_id, "ddpg_settings_apex_parts", seed)
    runs["halfcheetah_ddpg_settings_3step_1"] = ("HalfCheetah-v4", "ddpg_settings_3step", 1)
    runs["halfcheetah_paper_settings_1"] = ("HalfCheetah-v4", "paper_settings", 1)
    runs[f"{paper_env.split('-')[0].lower()}_paper_1"] = (paper_env, "paper", 1)
    return runs


def command_of(name: str, runs: dict, options) -> list[str]:
    env_id, mode, seed = runs[name]
    args = ["--env-id", env_id, *MODES[mode], "--seed", str(seed), "--run-name", name]
    if mode != "paper":
        args += ["--total-timesteps", str(options.total_timesteps)]
    return [f"cleanba/{SCRIPT}.py", *args, *shlex.split(options.extra_args)]


def sessions_of(work_dir: Path, name: str) -> list:
    """The [start, end] wall-clock times of a paper-setting run's sessions."""
    path = work_dir / f"{name}.sessions.json"
    return json.loads(path.read_text()) if path.exists() else []


def run(name: str, runs: dict, options):
    """Runs `name` under `nice -n 10`, continuing from its newest checkpoint if it has one; a
    paper-setting run gets SIGTERM once its sessions add up to --paper-minutes."""
    work_dir = options.work_dir
    run_dir = work_dir / "runs" / name
    mode = runs[name][1]
    sessions = sessions_of(work_dir, name)
    budget = options.paper_minutes * 60 - sum(end - start for start, end in sessions)
    if (run_dir / "summary.json").exists() or (mode == "paper" and budget <= 0):
        print(f"{name}: already run", flush=True)
        return
    resume = (run_dir / "checkpoints").exists()
    command = command_of(name, runs, options)
    command[0] = str(REPO / command[0])
    command += ["--resume"] if resume else []
    print(f"{name}: {'resuming' if resume else 'running'}", flush=True)
    start = time.time()
    with open(work_dir / f"{name}.log", "a") as log:
        process = subprocess.Popen(
            ["nice", "-n", "10", sys.executable, *command],
            cwd=work_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            code = process.wait(timeout=budget if mode == "paper" else None)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            code = process.wait()
    if mode == "paper":
        sessions.append([start, time.time()])
        (work_dir / f"{name}.sessions.json").write_text(json.dumps(sessions))
    if code not in (0, 128 + signal.SIGTERM):
        sys.exit(f"{name} stopped (exit {code}); see {work_dir / name}.log")


def run_speed(name: str, options):
    if (options.work_dir / "runs" / name / "summary.json").exists():
        print(f"{name}: already run", flush=True)
        return
    command = [str(REPO / "cleanba" / f"{SCRIPT}.py"), "--env-id", "HalfCheetah-v4", *SPEED[name]]
    print(f"{name}: running", flush=True)
    with open(options.work_dir / f"{name}.log", "w") as log:
        subprocess.run(
            ["nice", "-n", "10", sys.executable, *command, "--run-name", name],
            cwd=options.work_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )


def events(run_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator


def scalar(accumulator, tag: str) -> list:
    """(step, value, wall time) of every event of `tag`, in step order."""
    if tag not in accumulator.Tags()["scalars"]:
        return []
    return sorted((e.step, e.value, e.wall_time) for e in accumulator.Scalars(tag))


def elapsed_of(times, sessions: list) -> np.ndarray:
    """Seconds of the run at wall-clock `times`: the earlier sessions' durations plus the time into
    the session that holds it (without a session record, the time since the first event)."""
    times = np.asarray(times, np.float64)
    if not sessions:
        return times - times.min()
    elapsed = np.zeros_like(times)
    before = 0.0
    for start, end in sessions:
        inside = (times >= start) & (times <= end)
        elapsed[inside] = before + times[inside] - start
        before += end - start
    return elapsed


def result_of(name: str, runs: dict, work_dir: Path, paper_minutes: float) -> dict:
    """The CSV row of a run: final_return is the mean of the last 100 training episodes (with the
    exploration noise), eval_return the last evaluation's mean (10 episodes of the noiseless
    policy). A run without summary.json is partial: its figures come from its events."""
    env_id, mode, seed = runs[name]
    run_dir = work_dir / "runs" / name
    accumulator = events(run_dir)
    returns = [value for _, value, _ in scalar(accumulator, "charts/episodic_return")]
    evaluations = scalar(accumulator, "charts/eval_return")
    updates = scalar(accumulator, "stats/optimizer_steps")
    sessions = sessions_of(work_dir, name)
    times = [wall for _, _, wall in updates]
    steps = updates[-1][0] if updates else 0
    wall_time = float(elapsed_of(times, sessions).max()) if times else 0.0
    status = "partial"
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
        steps = summary["global_step"]
        wall_time = summary["wall_time_s"]
        status = "finished"
    elif mode == "paper" and sessions:
        wall_time = sum(end - start for start, end in sessions)
        status = "wall time" if wall_time >= 0.99 * paper_minutes * 60 else "partial"
    return dict(
        script=SCRIPT,
        mode=mode,
        env_id=env_id,
        seed=seed,
        steps=steps,
        final_return=round(float(np.mean(returns[-LAST_EPISODES:])), 1) if returns else None,
        eval_return=round(evaluations[-1][1], 1) if evaluations else None,
        sps=int(steps / wall_time) if wall_time else 0,
        wall_time_s=round(wall_time),
        updates_per_second=round(updates[-1][1] / wall_time, 1) if wall_time else 0.0,
        status=status,
    )


def speed_of(name: str, work_dir: Path) -> dict | None:
    """Environment steps and optimizer steps per second between the first and the last update that
    learned (compilation and the filling of the replay left out)."""
    run_dir = work_dir / "runs" / name
    if not (run_dir / "summary.json").exists():
        return None
    updates = [u for u in scalar(events(run_dir), "stats/optimizer_steps") if u[1] > 0]
    step0, updates0, time0 = updates[0]
    step1, updates1, time1 = updates[-1]
    return dict(
        steps_per_second=(step1 - step0) / (time1 - time0),
        updates_per_second=(updates1 - updates0) / (time1 - time0),
        seconds=time1 - time0,
        command=shlex.join(["python", f"cleanba/{SCRIPT}.py", "--env-id", "HalfCheetah-v4"])
        + " "
        + shlex.join([*SPEED[name], "--run-name", name]),
    )


def plot_ddpg_ratio(names: list, runs: dict, work_dir: Path, path: Path):
    env_ids = sorted({runs[name][0] for name in names})
    fig, axes = plt.subplots(1, len(env_ids), figsize=(6 * len(env_ids), 4.5), squeeze=False)
    for ax, env_id in zip(axes[0], env_ids):
        for index, name in enumerate(n for n in names if runs[n][0] == env_id):
            accumulator = events(work_dir / "runs" / name)
            mode = runs[name][1]
            seed = runs[name][2]
            evaluations = scalar(accumulator, "charts/eval_return")
            if evaluations:
                steps, values, _ = zip(*evaluations)
                ax.plot(steps, values, color=f"C{index}", label=f"{mode} seed {seed}, evaluation")
            training = scalar(accumulator, "charts/episodic_return")
            if training:
                steps, values, _ = zip(*training)
                smoothed = running_mean(np.array(values), LAST_EPISODES)
                ax.plot(
                    steps,
                    smoothed,
                    color=f"C{index}",
                    linestyle=":",
                    label=f"{mode} seed {seed}, training",
                )
        for reference, style, label in [(CLEANRL_DDPG, "--", "DDPG"), (CLEANRL_TD3, "-.", "TD3")]:
            mean, _ = reference[env_id]
            ax.axhline(
                mean, color="grey", linestyle=style, label=f"CleanRL JAX {label} 1M ({mean})"
            )
        ax.set(xlabel="environment steps", ylabel="episodic return", title=env_id)
        ax.legend(fontsize=7)
    fig.suptitle("Ape-X DPG at DDPG's replay ratio (one batch of 256 per environment step)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_paper(name: str, runs: dict, work_dir: Path, path: Path):
    accumulator = events(work_dir / "runs" / name)
    sessions = sessions_of(work_dir, name)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for tag, style, label in [
        ("charts/eval_return", "-", "evaluation (noiseless, 10 episodes)"),
        ("charts/episodic_return", ":", f"training (mean of {LAST_EPISODES})"),
    ]:
        series = scalar(accumulator, tag)
        if series:
            _, values, times = zip(*series)
            if tag == "charts/episodic_return":
                values = running_mean(np.array(values), LAST_EPISODES)
            axes[0].plot(elapsed_of(times, sessions) / 60, values, linestyle=style, label=label)
    updates = scalar(accumulator, "stats/optimizer_steps")
    if len(updates) > 1:
        steps, counts, times = (np.array(x) for x in zip(*updates))
        minutes = elapsed_of(times, sessions) / 60
        axes[1].plot(minutes[1:], steps[1:] / (minutes[1:] * 60), label="transitions per second")
        axes[1].plot(
            minutes[1:], counts[1:] / (minutes[1:] * 60), label="batches of 256 per second"
        )
    axes[0].set(xlabel="wall time (minutes)", ylabel="episodic return", title=runs[name][0])
    axes[1].set(xlabel="wall time (minutes)", ylabel="per second, since the start", yscale="log")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle("Ape-X DPG, the paper's setting on 2 CPU cores")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(runs: dict, options):
    work_dir = options.work_dir
    out = options.out
    names = [name for name in runs if (work_dir / "runs" / name).exists()]
    results = {name: result_of(name, runs, work_dir, options.paper_minutes) for name in names}
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(results.values())
    fmt = lambda value: "n/a" if value is None else f"{value:.0f}"
    table = [
        f"| run | task | mode | seed | steps | training return (last {LAST_EPISODES}) | eval "
        "return (last, 10 noiseless episodes) | SPS | batches/s | wall time (min) | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        table.append(
            f"| {name} | {r['env_id']} | {r['mode']} | {r['seed']} | {r['steps']:,} | "
            f"{fmt(r['final_return'])} | {fmt(r['eval_return'])} | {r['sps']} | "
            f"{r['updates_per_second']} | {r['wall_time_s'] / 60:.1f} | **{r['status']}** |"
        )
    groups = [
        "| task | finished seeds | training return, mean ± std | eval return, mean ± std | CleanRL "
        "JAX DDPG 1M | CleanRL JAX TD3 1M | target met (training return ≥ DDPG's mean) | "
        "training return to TD3's mean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for env_id in CLEANRL_DDPG:
        finished = [
            r
            for r in results.values()
            if r["env_id"] == env_id and r["mode"] == "ddpg_settings" and r["status"] == "finished"
        ]
        evaluations = [r["eval_return"] for r in finished if r["eval_return"] is not None]
        training = [r["final_return"] for r in finished if r["final_return"] is not None]
        ddpg_mean, ddpg_std = CLEANRL_DDPG[env_id]
        td3_mean, td3_std = CLEANRL_TD3[env_id]
        spread = lambda values: f"{np.mean(values):.0f} ± {np.std(values):.0f}" if values else "n/a"
        if training:
            ours = np.mean(training)
            groups.append(
                f"| {env_id} | {len(training)} | {spread(training)} | "
                f"{spread(evaluations)} | {ddpg_mean} ± {ddpg_std} | "
                f"{td3_mean} ± {td3_std} | {'yes' if ours >= ddpg_mean else 'no'} | "
                f"{ours - td3_mean:+.0f} ({(ours - td3_mean) / td3_std:+.1f} TD3 std) |"
            )
        else:
            groups.append(
                f"| {env_id} | 0 | not run | | {ddpg_mean} ± {ddpg_std} | {td3_mean} ± {td3_std} | "
                "| |"
            )
    done = [n for n in names if runs[n][1] != "paper"]
    if done:
        plot_ddpg_ratio(done, runs, work_dir, out.with_suffix(".png"))
    paper = [n for n in names if runs[n][1] == "paper"]
    paper_png = out.with_name(out.stem + "_paper.png")
    if paper:
        plot_paper(paper[0], runs, work_dir, paper_png)
    speeds = {name: speed_of(name, work_dir) for name in SPEED}
    speed_lines = [
        f"- `{s['command']}`: **{s['steps_per_second']:.0f} environment steps/s, "
        f"{s['updates_per_second']:.0f} optimizer steps (batches of 256)/s** over "
        f"{s['seconds']:.0f} s of learning"
        for s in speeds.values()
        if s is not None
    ]
    missing = [name for name in runs if name not in names]
    commands = "\n".join(shlex.join(["python", *command_of(n, runs, options)]) for n in runs)
    text = (
        f"# Ape-X DPG on a CPU ({options.date})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.machine()}, 2 CPU cores, Python {platform.python_version()}. Made by "
        f"`{command_line(sys.argv)}`. The learning runs, one at a time under `nice -n 10` (from "
        f"the repository root):\n\n```\n{commands}\n```\n\n"
        "`ddpg_settings`, the implementation check: one batch of 256 per environment step (8 "
        "environments x 8 steps, 64 optimizer steps per update), 1M steps, DDPG's settings where "
        "they differ from the paper's (relu networks of 256 and 256, learning rate 3e-4, noise σ "
        "0.1, 25,000 steps of uniform random actions and learning from then on, target copies "
        "every 400 batches, no dq/da clip, 1-step returns), with Ape-X's prioritized replay. "
        "`ddpg_settings_apex_parts`: the same with Ape-X's target copies every 100 batches, "
        "dq/da clipped to ±1 and no random phase. `ddpg_settings_3step`: that with the paper's "
        "3-step returns. `paper_settings`: the same ratio with the paper's other "
        "hyperparameters (tanh after the first layers of 400-300 and 300-200 units, 1e-4, σ "
        "0.3, learning from step 50,000, 3-step returns). `paper`: the script's defaults "
        "(the paper's: 64 environments, 1.6 samples per inserted transition), stopped after "
        f"{options.paper_minutes:g} minutes. Training return: the mean of the last "
        f"{LAST_EPISODES} training episodes, played with the exploration noise; eval return: the "
        "last evaluation, 10 episodes of the noiseless policy. CleanRL's figures are their final "
        "training returns (noise 0.1), mean ± std over seeds; the target compares like with like: "
        "our `ddpg_settings` training return (noise 0.1 too) with DDPG's mean. A partial run has "
        "not finished (it "
        "continues when the benchmark runs again).\n\n"
        + ("\n".join(table) if results else "No learning run has been made yet.")
        + "\n\n"
        + "\n".join(groups)
        + (f"\n\nNot run yet: {', '.join(missing)}." if missing else "")
        + "\n\nThe paper: about 14k transitions and 86 batches of 256 per second (64 actors on CPU "
        "cores, the learner on a GPU).\n"
        + ("\n## Speed\n\n" + "\n".join(speed_lines) + "\n" if speed_lines else "")
        + (f"\n{options.note}\n" if options.note else "")
        + (f"\n![curves]({out.with_suffix('.png').name})\n" if done else "")
        + (f"\n![the paper's setting]({paper_png.name})\n" if paper else "")
    )
    out.write_text(text)
    print(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--paper-env", default="HumanoidStand-v1")
    parser.add_argument("--paper-minutes", type=float, default=120.0)
    parser.add_argument("--runs", nargs="+", help="run only these (names as in the report)")
    parser.add_argument("--speed", action="store_true", help="run the speed measurements only")
    parser.add_argument(
        "--report-only", action="store_true", help="write the report from the runs that exist"
    )
    parser.add_argument("--total-timesteps", type=int, default=1_000_000)
    parser.add_argument(
        "--extra-args", default="", help="appended to every learning run's command (for a try)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_learning_apex_dpg_cpu"))
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark" / "results" / "learning_apex_dpg_cpu.md"
    )
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument(
        "--note", default="", help="a paragraph under the tables: how the machine was shared"
    )
    options = parser.parse_args()
    options.work_dir.mkdir(parents=True, exist_ok=True)
    runs = plan(options.seeds, options.paper_env)
    unknown = set(options.runs or []) - set(runs)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; the runs are {list(runs)}")
    if options.speed:
        for name in SPEED:
            run_speed(name, options)
    elif not options.report_only:
        for name in options.runs or list(runs):
            run(name, runs, options)
    report(runs, options)


if __name__ == "__main__":
    main()
