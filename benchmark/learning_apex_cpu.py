"""Evidence that cleanba_apex_dqn.py learns, on a CPU: CartPole-v1 over several seeds, with the
evaluation (`charts/eval_return`: the learner's current parameters, epsilon-greedy with epsilon
0.01, in evaluation environments of their own) beside the training returns of all actors (each
environment with its own exploration rate, from 0.4 down) and of the quarter of them with the
lowest epsilon (`charts/lowest_epsilon_return`).

nice -n 10 python benchmark/learning_apex_cpu.py --note "..."   # one run after another

Writes benchmark/results/learning_apex_cpu.md, .csv and .png. The runs change the script's defaults
only where a CPU needs it: a small MLP, few environments, a small replay and batch, an early start
of learning, a higher learning rate and a target period counted in fewer updates; with only 4
environments a flatter exploration spread (--epsilon-alpha 3), and a learning rate annealed to 0
(--anneal-lr), without which the evaluated policy of a finished run is wherever its swings left it.
Atari does not fit on two shared cores: the learner's step at the defaults takes seconds on this CPU
(see benchmark/results/replay_apex.md), so a run of millions of steps would take weeks.
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

from cleanba_utils.experiments.events import running_mean

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "cleanba" / "cleanba_apex_dqn.py"
CARTPOLE = (
    "--env-id CartPole-v1 --hiddens 64 64 --local-num-envs 4 --num-steps 8 --learning-starts 1000"
    " --buffer-size 20000 --batch-size 32 --updates-per-rollout 4 --learning-rate 1e-3"
    " --target-update-period 200 --log-frequency 500 --eval-episodes 10 --eval-every 25"
    " --epsilon-alpha 3 --anneal-lr"
)
TABLE_HEADER = "\n".join(
    [
        "| seed | steps | eval (epsilon 0.01), final | eval (epsilon 0.01), mean of the last 5 |"
        " training, all actors (last 100 episodes) | training, lowest-epsilon quarter (last 20"
        " episodes) | SPS"
        " | wall time (min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
)


def run(args: str, work_dir: Path) -> Path:
    run_name = args.split("--run-name ")[1].split()[0]
    run_dir = work_dir / "runs" / run_name
    if not (run_dir / "summary.json").exists():
        command = [sys.executable, str(SCRIPT), *args.split()]
        print(" ".join(command[1:]), flush=True)
        with open(work_dir / f"{run_name}.log", "w") as log:
            subprocess.run(command, cwd=work_dir, stdout=log, stderr=subprocess.STDOUT, check=True)
    return run_dir


def scalar(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return sorted((e.step, e.value) for e in events.Scalars(tag))


def result_of(run_dir: Path, seed: int) -> dict:
    """The CSV row of a run: final_return is the mean of the last 100 training episodes of all
    actors, eval_return the last evaluation's mean (epsilon 0.01)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    returns = [value for _, value in scalar(run_dir, "charts/episodic_return")]
    return dict(
        script="cleanba_apex_dqn",
        mode="pipelined",
        env_id="CartPole-v1",
        seed=seed,
        steps=summary["global_step"],
        final_return=round(float(np.mean(returns[-100:])), 1),
        eval_return=round(summary["eval_return"], 1),
        sps=summary["sps"],
        wall_time_s=round(summary["wall_time_s"]),
    )


def table_row(run_dir: Path, row: dict) -> str:
    lowest_epsilon = [value for _, value in scalar(run_dir, "charts/lowest_epsilon_return")]
    evaluations = [value for _, value in scalar(run_dir, "charts/eval_return")]
    return (
        f"| {row['seed']} | {row['steps']:,} | **{row['eval_return']:.1f}** | "
        f"{np.mean(evaluations[-5:]):.1f} | {row['final_return']:.1f} | "
        f"{np.mean(lowest_epsilon[-20:]):.1f} | {row['sps']} | {row['wall_time_s'] / 60:.1f} |"
    )


def plot(run_dirs: dict, path: Path):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained", sharey=True)
    for index, (seed, run_dir) in enumerate(run_dirs.items()):
        color = f"C{index}"
        steps, values = zip(*scalar(run_dir, "charts/eval_return"))
        axes[0].plot(steps, values, color=color, label=f"seed {seed}")
        steps, values = zip(*scalar(run_dir, "charts/episodic_return"))
        axes[1].plot(steps, running_mean(np.array(values), 100), color=color, label=f"seed {seed}")
    axes[0].set(
        xlabel="environment steps",
        ylabel="return",
        title="evaluation (epsilon-greedy, epsilon 0.01, mean of 10 episodes)",
    )
    axes[1].set(
        xlabel="environment steps", title="training, all actors (mean of the last 100 episodes)"
    )
    for ax in axes:
        ax.axhline(475, color="grey", linestyle="--", linewidth=1)
        ax.legend()
    fig.suptitle("Ape-X DQN, CartPole-v1")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cartpole-timesteps", type=int, default=250_000)
    parser.add_argument(
        "--cartpole-args", default=CARTPOLE, help="the script's arguments but steps, seed, run name"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_learning_apex_cpu"))
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark" / "results" / "learning_apex_cpu.md"
    )
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument(
        "--note", default="", help="a paragraph under the table: how the machine was shared"
    )
    options = parser.parse_args()
    options.work_dir.mkdir(parents=True, exist_ok=True)

    commands = []
    run_dirs = {}
    rows = []
    for seed in options.seeds:
        commands.append(
            f"{options.cartpole_args} --total-timesteps {options.cartpole_timesteps} --seed {seed}"
            f" --run-name cartpole_{seed}"
        )
        run_dirs[seed] = run(commands[-1], options.work_dir)
        rows.append(result_of(run_dirs[seed], seed))
    plot(run_dirs, options.out.with_suffix(".png"))
    with open(options.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RUN_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    evals = [row["eval_return"] for row in rows]
    pooled = [row["final_return"] for row in rows]
    command_lines = "\n".join(f"python cleanba/cleanba_apex_dqn.py {c}" for c in commands)
    table = "\n".join(table_row(run_dirs[row["seed"]], row) for row in rows)
    text = f"""# Ape-X DQN learning on a CPU ({options.date})

{stack_line()}

Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}.
Made by `{command_line(sys.argv)}`, which ran:

```
{command_lines}
```

{TABLE_HEADER}
{table}

Final evaluation (after the last update, 10 episodes, epsilon-greedy with epsilon 0.01): mean
**{np.mean(evals):.1f}** over {len(evals)} seeds (min {min(evals):.1f}); the pooled training returns
of all actors: mean {np.mean(pooled):.1f}. Results also in
[learning_apex_cpu.csv](learning_apex_cpu.csv).

![CartPole-v1](learning_apex_cpu.png)

The evaluation (epsilon 0.01) is what the policy can do; the training return of all actors counts
every environment, the most exploring one (epsilon 0.4, whose short episodes are the most numerous)
included, so it stays below. Evaluation never changes the run: its environments and seeds are its
own (the same fingerprint with and without it, tests/test_apex_dqn.py).

{options.note}
"""
    options.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
