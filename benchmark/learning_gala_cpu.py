"""GALA-A2C on a CPU: CartPole-v1 over several seeds for sync gossip, async gossip and all-reduce
A2C (4 agents x 16 environments each: the same total batch and number of simulators), and the ε-ball
of sync gossip at two learning rates.

python benchmark/learning_gala_cpu.py              # 17 runs of 500k steps, about 40 min alone
python benchmark/learning_gala_cpu.py --timesteps 200000 --seeds 1 2 3

Writes benchmark/results/learning_gala_cpu.md (tables and the exact commands),
learning_gala_cpu.csv (one row per run), learning_gala_cpu_steps.png (the mean of the last 100
episodes against steps) and learning_gala_cpu_epsilon_ball.png. Every hyperparameter is the script's
default (the paper's, the learning rate scaled by √4 included) except the network, an MLP 64-64, and
the steps. The 4 agents run on 4 simulated CPU devices. Each run ends with an evaluation of the
agents' average x̄ (greedy actions, 20 episodes). Atari is not run here: a Breakout run long enough
to learn does not fit two shared cores.
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
from csv_columns import RUN_COLUMNS
from measure import command_line, stack_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "cleanba_gala_a2c.py"
MODES = {
    "gala_sync": ["--topology", "gossip", "--gossip", "sync"],
    "gala_async": ["--topology", "gossip", "--gossip", "async"],
    "a2c_allreduce": ["--topology", "allreduce"],
}
# Sync gossip at half the base learning rate: how the ε-ball scales with it.
HALF_LR_MODE = "gala_sync_half_lr"
HALF_LR = ["--topology", "gossip", "--gossip", "sync", "--learning-rate", "3.5e-4"]
CARTPOLE = ["--env-id", "CartPole-v1", "--hiddens", "64", "64", "--log-frequency", "100"]
EVAL_EPISODES = 20
LAST_N = 100
THRESHOLD = 475.0  # CartPole-v1's reward threshold


def run(args, work_dir, log_dir):
    command = [sys.executable, str(REPO / "cleanba" / SCRIPT), *args]
    print(" ".join(command[1:]), flush=True)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    with open(log_dir / f"{args[args.index('--run-name') + 1]}.log", "w") as log:
        subprocess.run(
            command, cwd=work_dir, env=env, stdout=log, stderr=subprocess.STDOUT, check=True
        )


def scalars(run_dir, prefix: str) -> dict:
    """{tag: [(step, value), ...]} of the tags that start with `prefix`, sorted by step."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag.startswith(prefix)]
    return {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in tags}


def running_mean(values, n: int) -> np.ndarray:
    """The mean of the last `n` values (fewer at the start)."""
    sums = np.cumsum(np.insert(np.asarray(values, float), 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), n)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


def analyze(run_dir, mode: str, seed: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    logged = scalars(run_dir, "charts/") | scalars(run_dir, "stats/consensus")
    steps, returns = zip(*logged["charts/episodic_return"])
    curve = running_mean(returns, LAST_N)
    full = np.arange(len(curve)) >= LAST_N - 1  # a mean over 100 episodes
    reached = [step for step, score, ok in zip(steps, curve, full) if ok and score >= THRESHOLD]
    epsilon = logged["stats/consensus_distance_max"]
    second_half = [value for step, value in epsilon if step >= summary["global_step"] / 2]
    return dict(
        script=SCRIPT,
        mode=mode,
        env_id="CartPole-v1",
        seed=seed,
        steps=summary["global_step"],
        final_return=round(float(np.mean(returns[-LAST_N:])), 1),
        eval_return=round(logged["charts/eval_return"][-1][1], 1),
        sps=summary["sps"],
        wall_time_s=round(summary["wall_time_s"]),
        steps_to_475=reached[0] if reached else None,
        epsilon_second_half=float(np.mean(second_half)),
        curve=(np.array(steps), curve),
        epsilon=epsilon,
    )


def mean_std(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}"


def plot_curves(rows, path, num_steps: int):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = np.linspace(0, num_steps, 200)
    for mode in MODES:
        curves = [r["curve"] for r in rows if r["mode"] == mode]
        if not curves:
            continue
        on_grid = np.array([np.interp(grid, steps, curve) for steps, curve in curves])
        (line,) = ax.plot(grid, on_grid.mean(0), label=f"{mode} ({len(curves)} seeds)")
        ax.fill_between(grid, on_grid.min(0), on_grid.max(0), color=line.get_color(), alpha=0.2)
    ax.axhline(THRESHOLD, color="gray", linestyle="--", linewidth=1, label="475")
    ax.set(
        title=f"CartPole-v1, 4 agents x 16 envs: mean of the last {LAST_N} episodes "
        "(band: min-max over seeds)",
        xlabel="environment steps (all agents)",
        ylabel="episodic return",
    )
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_epsilon_ball(rows, path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"gala_sync": "C0", HALF_LR_MODE: "C2", "gala_async": "C1"}
    for row in rows:
        if row["mode"] not in colors:
            continue
        steps, values = zip(*row["epsilon"])
        first = row["seed"] == min(r["seed"] for r in rows if r["mode"] == row["mode"])
        ax.plot(
            steps,
            values,
            color=colors[row["mode"]],
            alpha=0.6,
            linewidth=0.8,
            label=row["mode"] if first else None,
        )
    ax.set(
        title="ε = max_i ‖x_i − x̄‖ (base learning rate 7e-4, half: 3.5e-4; both x √4)",
        xlabel="environment steps (all agents)",
        yscale="log",
    )
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timesteps", type=int, default=500_000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument(
        "--half-lr-seeds", type=int, nargs="*", default=[1, 2], help="sync gossip at half the lr"
    )
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
    runs_dir = options.work_dir / "runs"
    log_dir = options.work_dir / "logs"
    for folder in [runs_dir, log_dir, options.out_dir]:
        folder.mkdir(parents=True, exist_ok=True)

    def command(mode, mode_args, seed):
        return [
            *CARTPOLE,
            *mode_args,
            "--total-timesteps",
            str(options.timesteps),
            "--eval-episodes",
            str(EVAL_EPISODES),
            "--seed",
            str(seed),
            "--exp-name",
            mode,
            "--run-name",
            f"{mode}_{seed}",
        ]

    # Seed by seed, so that a shortened benchmark still compares the modes on the same seeds.
    planned = [
        (mode, seed, command(mode, MODES[mode], seed)) for seed in options.seeds for mode in MODES
    ]
    planned[2 * len(MODES) : 2 * len(MODES)] = [
        (HALF_LR_MODE, seed, command(HALF_LR_MODE, HALF_LR, seed)) for seed in options.half_lr_seeds
    ]
    finished = lambda mode, seed: (runs_dir / f"{mode}_{seed}" / "summary.json").exists()
    for mode, seed, args in planned:
        if not finished(mode, seed) and not options.analyze_only:
            run(args, options.work_dir, log_dir)
    missing = [f"{mode}_{seed}" for mode, seed, _ in planned if not finished(mode, seed)]
    done = [(mode, seed) for mode, seed, _ in planned if finished(mode, seed)]
    modes = [*MODES, HALF_LR_MODE]
    rows = sorted(
        [analyze(runs_dir / f"{mode}_{seed}", mode, seed) for mode, seed in done],
        key=lambda r: (modes.index(r["mode"]), r["seed"]),
    )

    columns = [*RUN_COLUMNS, "steps_to_475", "epsilon_second_half"]
    with open(options.out_dir / "learning_gala_cpu.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot_curves(rows, options.out_dir / "learning_gala_cpu_steps.png", options.timesteps)
    plot_epsilon_ball(rows, options.out_dir / "learning_gala_cpu_epsilon_ball.png")

    per_seed = [
        "| mode | seed | steps | final return (last 100 episodes) | evaluation of x̄ (greedy, "
        f"{EVAL_EPISODES} episodes) | steps to 475 | SPS | wall time (s) | mean ε over the "
        "second half |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed.append(
            f"| {r['mode']} | {r['seed']} | {r['steps']:,} | {r['final_return']} | "
            f"{r['eval_return']} | {r['steps_to_475'] or 'not reached'} | {r['sps']} | "
            f"{r['wall_time_s']} | {r['epsilon_second_half']:.3g} |"
        )
    summary = [
        "| mode | seeds | final return, mean ± std | evaluation of x̄, mean ± std | runs that "
        "reached 475 (first step, mean) | mean ε over the second half |",
        "|---|---|---|---|---|---|",
    ]
    for mode in modes:
        mode_rows = [r for r in rows if r["mode"] == mode]
        if not mode_rows:
            continue
        reached = [r["steps_to_475"] for r in mode_rows if r["steps_to_475"] is not None]
        first = f" ({np.mean(reached):,.0f})" if reached else ""
        epsilon = np.mean([r["epsilon_second_half"] for r in mode_rows])
        summary.append(
            f"| {mode} | {len(mode_rows)} | {mean_std(r['final_return'] for r in mode_rows)} | "
            f"{mean_std(r['eval_return'] for r in mode_rows)} | {len(reached)}/{len(mode_rows)}"
            f"{first} | {epsilon:.3g} |"
        )
    command_lines = "\n".join(
        f"XLA_FLAGS=--xla_force_host_platform_device_count=4 python cleanba/{SCRIPT} "
        + " ".join(args)
        for _, _, args in planned
    )
    (options.out_dir / "learning_gala_cpu.md").write_text(
        f"# GALA-A2C CPU benchmark ({options.date})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}. Made by `{command_line(sys.argv)}`, which ran "
        "(one run at a time):\n\n"
        f"```\n{command_lines}\n```\n\n"
        + (f"Not run (out of time): {', '.join(missing)}.\n\n" if missing else "")
        + "\n".join(summary)
        + "\n\n"
        + "\n".join(per_seed)
        + (f"\n\n{options.note}" if options.note else "")
        + "\n\n![return vs steps](learning_gala_cpu_steps.png)\n\n"
        + "![epsilon ball](learning_gala_cpu_epsilon_ball.png)\n"
    )
    print((options.out_dir / "learning_gala_cpu.md").read_text())


if __name__ == "__main__":
    main()
