"""Evidence that every script learns, on a CPU: CartPole-v1 x 3 seeds per script (Atari:
learning_atari_cpu.py).

    python benchmark/learning_cpu.py                      # about 10 min on 2 cores
    python benchmark/learning_cpu.py --seeds 1 2 3 --date 2026-11-21

Writes benchmark/results/learning_cpu.md (the table), learning_cpu_cartpole.png and
learning_cpu_scores.csv. Every hyperparameter is the script's default (the paper's Atari settings),
except the network (separate 64-64 MLPs), the number of environments (2 actor threads x 4) and the
steps.
"""

import argparse
import csv
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from measure import stack_line

from cleanba_utils.experiments.hns import collect

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["cleanba_ppo", "cleanba_impala"]
CARTPOLE = ["--env-id", "CartPole-v1", "--hiddens", "64", "64", "--local-num-envs", "4"]
# CartPole-v1 episodes end at 500 steps; 195 is the classic "solved" level of CartPole.
THRESHOLDS = {"CartPole-v1": 195.0}
LAST_N = 100


def run(script, args, runs_dir, log_dir):
    command = [sys.executable, str(REPO / "cleanba" / f"{script}.py"), *args]
    print(" ".join(command[1:]), flush=True)
    with open(log_dir / f"{args[args.index('--run-name') + 1]}.log", "w") as log:
        subprocess.run(
            command, cwd=runs_dir.parent, stdout=log, stderr=subprocess.STDOUT, check=True
        )


def steps_to_threshold(curve, threshold):
    reached = [point["global_step"] for point in curve if point["score"] >= threshold]
    return reached[0] if reached else None


def plot(curves, env_id, path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algorithm in SCRIPTS:
        runs = {
            seed: rows
            for (alg, env, seed), rows in curves.items()
            if alg == algorithm and env == env_id
        }
        grid = np.linspace(0, min(rows[-1]["global_step"] for rows in runs.values()), 200)
        on_grid = np.array(
            [
                np.interp(grid, [r["global_step"] for r in rows], [r["score"] for r in rows])
                for rows in runs.values()
            ]
        )
        (line,) = ax.plot(
            grid, on_grid.mean(0), label=f"{algorithm} ({len(runs)} seed{'s' * (len(runs) > 1)})"
        )
        if len(runs) > 1:
            ax.fill_between(grid, on_grid.min(0), on_grid.max(0), color=line.get_color(), alpha=0.2)
    ax.axhline(THRESHOLDS[env_id], color="gray", linestyle="--", linewidth=1, label="threshold")
    ax.set(
        title=f"{env_id} on 2 CPU cores (mean of last {LAST_N} episodes; band: min-max over seeds)",
        xlabel="environment steps",
        ylabel="episodic return",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cartpole-timesteps", type=int, default=500_000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="CartPole seeds")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_learning_cpu"))
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmark" / "results")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    options = parser.parse_args()
    runs_dir = options.work_dir / "runs"
    log_dir = options.work_dir / "logs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    options.out_dir.mkdir(parents=True, exist_ok=True)

    commands = []
    for script in SCRIPTS:
        for seed in options.seeds:
            commands.append(
                (
                    script,
                    [
                        *CARTPOLE,
                        "--total-timesteps",
                        str(options.cartpole_timesteps),
                        "--seed",
                        str(seed),
                        "--run-name",
                        f"{script}_cartpole_{seed}",
                    ],
                )
            )
    for script, args in commands:
        if not (runs_dir / args[args.index("--run-name") + 1] / "summary.json").exists():
            run(script, args, runs_dir, log_dir)

    scores, curve_rows = collect(runs_dir, "episodic_return", LAST_N, {})
    curves = {}
    for row in curve_rows:
        curves.setdefault((row["algorithm"], row["env_id"], row["seed"]), []).append(row)
    summaries = {}
    for run_dir in runs_dir.iterdir():
        spec = json.loads((run_dir / "spec.json").read_text())["args"]
        summaries[spec["exp_name"], spec["env_id"], spec["seed"]] = json.loads(
            (run_dir / "summary.json").read_text()
        )
    rows = []
    for score in scores:
        key = (score["algorithm"], score["env_id"], score["seed"])
        summary = summaries[key]
        reached = steps_to_threshold(curves[key], THRESHOLDS[key[1]])
        rows.append(
            dict(
                algorithm=key[0],
                env_id=key[1],
                seed=key[2],
                steps=summary["global_step"],
                final_return=round(score["score"], 1),
                steps_to_threshold=reached,
                sps=summary["sps"],
                wall_time_min=round(summary["wall_time_s"] / 60, 1),
            )
        )
    with open(options.out_dir / "learning_cpu_scores.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(curves, "CartPole-v1", options.out_dir / "learning_cpu_cartpole.png")

    table = [
        "| script | env | seed | steps | final return (last 100 episodes) | steps to threshold "
        "| SPS | wall time (min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        threshold = (
            f"{r['steps_to_threshold']:,} (≥ {THRESHOLDS[r['env_id']]:g})"
            if r["steps_to_threshold"]
            else f"not reached (≥ {THRESHOLDS[r['env_id']]:g})"
        )
        table.append(
            f"| {r['algorithm']} | {r['env_id']} | {r['seed']} | {r['steps']:,} "
            f"| {r['final_return']} | {threshold} | {r['sps']} | {r['wall_time_min']} |"
        )
    command_lines = "\n".join(
        f"python cleanba/{script}.py {' '.join(args)}" for script, args in commands
    )
    (options.out_dir / "learning_cpu.md").write_text(
        f"# CPU learning benchmark ({options.date})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.processor() or platform.machine()}, 2 CPU cores, "
        f"Python {platform.python_version()}. "
        f"Made by `python benchmark/learning_cpu.py {' '.join(sys.argv[1:])}`, which ran:\n\n"
        f"```\n{command_lines}\n```\n\n" + "\n".join(table) + "\n\n"
        "![CartPole](learning_cpu_cartpole.png)\n\n"
        "Atari: [learning_atari_cpu.md](learning_atari_cpu.md).\n"
    )
    print((options.out_dir / "learning_cpu.md").read_text())


if __name__ == "__main__":
    main()
