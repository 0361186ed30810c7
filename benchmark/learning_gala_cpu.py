"""GALA-A2C on a CPU: CartPole-v1 x 3 seeds for sync gossip, async gossip and all-reduce A2C (4 agents
x 16 environments each, so the same number of simulators), the measured ε-ball, and a short Breakout
run with the steps per second of every agent and of the whole.

python benchmark/learning_gala_cpu.py                         # about 25 min of CPU on 2 cores
python benchmark/learning_gala_cpu.py --cartpole-timesteps 100000 --breakout-timesteps 8000

Writes benchmark/results/learning_gala_cpu.md (tables and the exact commands),
learning_gala_cpu_steps.png, learning_gala_cpu_wall_time.png, learning_gala_cpu_epsilon_ball.png and
learning_gala_cpu_scores.csv. Every hyperparameter is the script's default except the network (an
MLP 64-64 for CartPole, a reduced IMPALA ResNet for Breakout) and the steps. The 4 agents run on 4
simulated CPU devices.
"""

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from measure import command_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cleanba_utils.experiments.hns import collect

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "gala_sync": ["--topology", "gossip", "--gossip", "sync"],
    "gala_async": ["--topology", "gossip", "--gossip", "async"],
    "a2c_allreduce": ["--topology", "allreduce"],
}
CARTPOLE = ["--env-id", "CartPole-v1", "--hiddens", "64", "64", "--log-frequency", "100"]
BREAKOUT = [
    "--env-id",
    "Breakout-v5",
    "--channels",
    "4",
    "8",
    "--hiddens",
    "64",
    "--log-frequency",
    "10",
]
LAST_N = 100
THRESHOLD = 195.0  # the classic "solved" level of CartPole


def run(args, runs_dir, log_dir):
    command = [sys.executable, str(REPO / "cleanba" / "cleanba_gala_a2c.py"), *args]
    print(" ".join(command[1:]), flush=True)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    with open(log_dir / f"{args[args.index('--run-name') + 1]}.log", "w") as log:
        subprocess.run(
            command, cwd=runs_dir.parent, env=env, stdout=log, stderr=subprocess.STDOUT, check=True
        )


def scalars(run_dir, prefix: str) -> dict:
    """{tag: [(step, value), ...]} of the tags that start with `prefix`, sorted by step."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag.startswith(prefix)]
    return {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in tags}


def plot_curves(curves, x: str, path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in MODES:
        runs = [
            rows
            for (algorithm, env_id, _), rows in curves.items()
            if algorithm == mode and env_id == "CartPole-v1"
        ]
        if not runs:
            continue
        grid = np.linspace(0, min(rows[-1][x] for rows in runs), 200)
        on_grid = np.array(
            [np.interp(grid, [r[x] for r in rows], [r["score"] for r in rows]) for rows in runs]
        )
        (line,) = ax.plot(grid, on_grid.mean(0), label=f"{mode} ({len(runs)} seeds)")
        ax.fill_between(grid, on_grid.min(0), on_grid.max(0), color=line.get_color(), alpha=0.2)
    ax.axhline(THRESHOLD, color="gray", linestyle="--", linewidth=1, label="195")
    xlabel = (
        "environment steps (all agents)"
        if x == "global_step"
        else f"wall time (s) on {os.cpu_count()} CPU cores"
    )
    ax.set(
        title=f"CartPole-v1, 4 agents x 16 envs (mean of last {LAST_N} episodes; band: min-max over seeds)"
    )
    ax.set(xlabel=xlabel, ylabel="episodic return")
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_epsilon_ball(balls, path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (mode, seed), logged in sorted(balls.items()):
        color = "C0" if mode == "gala_sync" else "C1"
        for ax, tag in zip(axes, ["stats/consensus_distance_max", "stats/consensus_share"]):
            steps, values = zip(*logged[tag])
            ax.plot(steps, values, color=color, alpha=0.7, label=f"{mode}" if seed == 1 else None)
    axes[0].set(title="ε = max_i ‖x_i − x̄‖", xlabel="environment steps", yscale="log")
    axes[1].set(title="ε / ‖x̄‖", xlabel="environment steps", yscale="log")
    for ax in axes:
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cartpole-timesteps", type=int, default=300_000)
    parser.add_argument("--breakout-timesteps", type=int, default=20_480)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_learning_gala_cpu"))
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmark" / "results")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument(
        "--analyze-only", action="store_true", help="report the finished runs, run nothing"
    )
    parser.add_argument(
        "--note", default="", help="a paragraph under the tables: how the machine was shared"
    )
    options = parser.parse_args()
    runs_dir, log_dir = options.work_dir / "runs", options.work_dir / "logs"
    for folder in [runs_dir, log_dir, options.out_dir]:
        folder.mkdir(parents=True, exist_ok=True)

    def command(base, mode, timesteps, seed, env_name):
        run_name = f"{mode}_{env_name}_{seed}"
        return [
            *base,
            *MODES[mode],
            "--total-timesteps",
            str(timesteps),
            "--seed",
            str(seed),
            "--exp-name",
            mode,
            "--run-name",
            run_name,
        ]

    commands = [
        command(CARTPOLE, mode, options.cartpole_timesteps, seed, "cartpole")
        for mode in MODES
        for seed in options.seeds
    ]
    commands += [
        command(BREAKOUT, mode, options.breakout_timesteps, 1, "breakout")
        for mode in ["gala_sync", "gala_async"]
    ]
    finished = lambda args: (
        runs_dir / args[args.index("--run-name") + 1] / "summary.json"
    ).exists()
    for args in commands:
        if not finished(args) and not options.analyze_only:
            run(args, runs_dir, log_dir)
    missing = [args[args.index("--run-name") + 1] for args in commands if not finished(args)]

    scores, curve_rows = collect(runs_dir, "episodic_return", LAST_N, {})
    done = lambda row: (
        runs_dir
        / f"{row['algorithm']}_{row['env_id'].split('-')[0].lower()}_{row['seed']}"
        / "summary.json"
    ).exists()
    scores, curve_rows = (
        [row for row in scores if done(row)],
        [row for row in curve_rows if done(row)],
    )
    curves = {}
    for row in curve_rows:
        curves.setdefault((row["algorithm"], row["env_id"], row["seed"]), []).append(row)
    rows, balls, breakout = [], {}, []
    for score in sorted(
        scores, key=lambda s: (s["env_id"], list(MODES).index(s["algorithm"]), s["seed"])
    ):
        mode, env_id, seed = score["algorithm"], score["env_id"], score["seed"]
        run_dir = (
            runs_dir / f"{mode}_{'cartpole' if env_id == 'CartPole-v1' else 'breakout'}_{seed}"
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        logged = scalars(run_dir, "stats/consensus") | scalars(run_dir, "charts/")
        reached = [p["global_step"] for p in curves[mode, env_id, seed] if p["score"] >= THRESHOLD]
        share = logged["stats/consensus_share"]
        row = dict(
            mode=mode,
            env_id=env_id,
            seed=seed,
            steps=summary["global_step"],
            final_return=round(score["score"], 1),
        )
        row.update(steps_to_195=reached[0] if reached else None, sps=summary["sps"])
        row.update(wall_time_s=round(summary["wall_time_s"]), final_share=share[-1][1])
        row.update(
            max_share_second_half=max(v for s, v in share if s >= summary["global_step"] / 2)
        )
        rows.append(row)
        if env_id == "CartPole-v1" and mode != "a2c_allreduce":
            balls[mode, seed] = logged
        if env_id == "Breakout-v5":
            agent_sps = [logged[f"charts/agent_{a}/SPS"][-1][1] for a in range(4)]
            breakout.append(
                dict(
                    mode=mode, sps=summary["sps"], agent_sps=agent_sps, wall=summary["wall_time_s"]
                )
            )
    with open(options.out_dir / "learning_gala_cpu_scores.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_curves(curves, "global_step", options.out_dir / "learning_gala_cpu_steps.png")
    plot_curves(curves, "wall_time_s", options.out_dir / "learning_gala_cpu_wall_time.png")
    plot_epsilon_ball(balls, options.out_dir / "learning_gala_cpu_epsilon_ball.png")

    table = [
        "| mode | env | seed | steps | final return (last 100 episodes) | steps to 195 | SPS | wall time (s) "
        "| ε/‖x̄‖ at the end | max ε/‖x̄‖ over the second half |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['mode']} | {r['env_id']} | {r['seed']} | {r['steps']:,} | {r['final_return']} | "
            f"{r['steps_to_195'] or 'not reached'} | {r['sps']} | {r['wall_time_s']} | {r['final_share']:.2g} | "
            f"{r['max_share_second_half']:.2g} |"
        )
    sps_table = ["| mode | SPS, whole run | SPS per agent (0, 1, 2, 3) |", "|---|---|---|"]
    sps_table += [
        f"| {b['mode']} | {b['sps']} | {', '.join(f'{s:.0f}' for s in b['agent_sps'])} |"
        for b in breakout
    ]
    command_lines = "\n".join(
        "XLA_FLAGS=--xla_force_host_platform_device_count=4 python cleanba/cleanba_gala_a2c.py "
        + " ".join(args)
        for args in commands
    )
    (options.out_dir / "learning_gala_cpu.md").write_text(
        f"# GALA-A2C CPU benchmark ({options.date})\n\n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}. Made by "
        f"`{command_line(sys.argv)}`, which ran:\n\n"
        f"```\n{command_lines}\n```\n\n"
        + (f"Not run (out of time): {', '.join(missing)}.\n\n" if missing else "")
        + "\n".join(table)
        + "\n\nBreakout-v5 (reduced network), steps per second:\n\n"
        + "\n".join(sps_table)
        + (f"\n\n{options.note}" if options.note else "")
        + "\n\n![return vs steps](learning_gala_cpu_steps.png)\n\n"
        + "![return vs wall time](learning_gala_cpu_wall_time.png)\n\n"
        + "![epsilon ball](learning_gala_cpu_epsilon_ball.png)\n"
    )
    print((options.out_dir / "learning_gala_cpu.md").read_text())


if __name__ == "__main__":
    main()
